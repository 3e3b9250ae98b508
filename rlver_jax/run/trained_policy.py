"""The trained policy of a training workdir: restore it from WORKDIR/checkpoints, export it as HF.

The run's WORKDIR/config.json says how the trainer built the policy; only the policy entry of the
checkpoint's state is read (optimizer and critic states stay on disk), straight into the shardings
of the mesh at hand, and checked against the checksums saved with it (`checkpoint_integrity`).
"""
from __future__ import annotations

import json
import logging

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from rlver_jax import build
from rlver_jax.models import export_pretrained
from rlver_jax.models.io import hub, storage
from rlver_jax.models.io import safetensors as st
from rlver_jax.models.factory import abstract_model, state_shardings
from rlver_jax.models.io.hf import read_config
from rlver_jax.models.presets import param_dtype_of
from rlver_jax.parallel.sharding import MeshConfig, make_mesh
from rlver_jax.run import checkpoint_integrity, library_noise
from rlver_jax.run.checkpoint import open_manager
from rlver_jax.run.checkpoint_errors import describe
from rlver_jax.spec import PolicySpec, RunSpec


class ExportError(ValueError):
  """Bad input for an export; the message says what to fix."""


def load_run_config(workdir: str) -> RunSpec:
  """The run's spec from WORKDIR/config.json (written by the trainer at start; keys this version does
  not know are skipped)."""
  path = storage.join(workdir, "config.json")
  if not storage.exists(path):
    raise ExportError(f"{path} is missing: {workdir} is not a training workdir")
  config = json.loads(storage.read_bytes(path))
  # `kind` says what wrote it; a config.json from before it was written has rl and policy sections.
  kind = config.get("kind") if isinstance(config, dict) else None
  if kind is None and not (isinstance(config, dict) and "rl" in config and "policy" in config):
    raise ExportError(f"{path} is not a training run's config (no rl / policy sections)")
  if kind not in (None, RunSpec.KIND):
    raise ExportError(f"{path} is an {kind} config, not a training run's: {workdir} is not a "
                      "training workdir")
  return RunSpec.from_config(config, strict=False)


def _manager(workdir: str) -> ocp.CheckpointManager:
  """Read-only manager over WORKDIR/checkpoints that can restore a subset of the state item."""
  directory = epath.Path(workdir) / "checkpoints"
  if not directory.exists():
    raise ExportError(f"no checkpoints under {directory}")
  absl_logger = logging.getLogger("absl")  # orbax logs through absl
  absl_logger.addFilter(_no_read_only_note)
  try:
    return open_manager(workdir)
  finally:
    absl_logger.removeFilter(_no_read_only_note)


def _no_read_only_note(record: logging.LogRecord) -> bool:
  """Drops orbax's "Given directory is read only=DIR" for a manager opened read-only: the directory
  is writable, only this reader will not write to it, and a user took the line for a problem."""
  return record.msg != "Given directory is read only=%s"


def pick_step(manager: ocp.CheckpointManager, step: int | None) -> int:
  steps = sorted(manager.all_steps())
  if not steps:
    raise ExportError(f"no checkpoints under {manager.directory}")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise ExportError(f"step {step} not found under {manager.directory} (available: "
                      f"{', '.join(map(str, steps))})")
  return step


def restore_policy(policy: PolicySpec, manager: ocp.CheckpointManager, step: int,
                   mesh: jax.sharding.Mesh):
  """(model, model config, base checkpoint dir): the policy of `step`, sharded over `mesh`.

  The target is the policy's abstract state (built like `build.load_policy`, nothing allocated);
  orbax reads only that part of the checkpoint straight into the target shardings.
  """
  path = build.resolve_checkpoint(policy.checkpoint, "policy.checkpoint")
  model_config = read_config(path)
  p = policy
  graphdef, abstract = nnx.split(abstract_model(
      model_config, head="lm", param_dtype=param_dtype_of(p.param_dtype),
      dtype=param_dtype_of(p.compute_dtype), remat=p.remat))
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, state_shardings(abstract, mesh))
  target = {"policy": target}
  try:
    with library_noise.reading_checkpoints():
      restored = manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
              item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
              partial_restore=True),
          meta=ocp.args.JsonRestore()))
    checkpoint_integrity.verify(restored["state"],
                                restored["meta"].get(checkpoint_integrity.CHECKSUMS))
  except Exception as e:  # orbax / tensorstore raise many kinds for a damaged file
    raise ExportError(_damaged_line(manager, step, e)) from e
  return nnx.merge(graphdef, restored["state"]["policy"]), model_config, path


def _damaged_line(manager: ocp.CheckpointManager, step: int, e: Exception) -> str:
  """Read-only: the damaged checkpoint is named, not moved (a training run moves it aside)."""
  library_noise.collect_restore_debris()
  others = [s for s in sorted(manager.all_steps(), reverse=True) if s != step]
  todo = (f"pass --step={others[0]} for the newest other one (steps {', '.join(map(str, others))})"
          if others else "there is no other checkpoint")
  return (f"the checkpoint of step {step} in {manager.directory} does not restore ({describe(e)}); "
          f"{todo}")


def load_trained(workdir: str, step: int | None, mesh: jax.sharding.Mesh):
  """(model, base checkpoint dir, step, run spec): the policy of `step` (default: the latest) of a
  training workdir, sharded over `mesh` (call inside `jax.set_mesh(mesh)`)."""
  spec = load_run_config(workdir)
  manager = _manager(workdir)
  try:
    step = pick_step(manager, step)
    model, _, base = restore_policy(spec.policy, manager, step, mesh)
  finally:
    manager.close()
  return model, base, step, spec


def _check_out(out: str, workdir: str, overwrite: bool) -> None:
  if storage.same_dir(out, workdir) or storage.exists(storage.join(out, "checkpoints")):
    raise ExportError(f"output directory {out} is a training workdir; choose another one")
  existing = storage.list_dir(out)
  if existing and not overwrite:
    raise ExportError(f"output directory {out} is not empty ({len(existing)} entries); pass "
                      "--overwrite to write over it")


def _input_checkpoints(spec: RunSpec) -> dict[str, str]:
  """config key -> directory of each checkpoint the run reads (base policy, critic, simulator);
  Hub ids left out: their snapshots live in the Hugging Face cache, not at a path one exports to."""
  paths = {"policy.checkpoint": spec.policy.checkpoint, "critic.checkpoint": spec.critic.checkpoint,
           "simulator.checkpoint": spec.simulator.checkpoint,
           "simulator.draft_checkpoint": spec.simulator.draft_checkpoint}
  return {key: build.checkpoint_dir(path) for key, path in paths.items()
          if path and not hub.is_hub_id(path)}


def _check_not_an_input(out: str, spec: RunSpec) -> None:
  # Overwriting the base policy would lose the weights the run (its KL reference, a resume) reads.
  for key, path in _input_checkpoints(spec).items():
    if storage.same_dir(out, path):
      raise ExportError(f"output directory {out} is the run's {key}; choose another one")


def base_dtype(base: str) -> str:
  """The export's default dtype: the base checkpoint's config.json dtype, else its stored weights'.

  (Without a named dtype the config reader assumes bfloat16, which would quietly halve an fp32 base.)
  """
  cfg = json.loads(storage.read_bytes(storage.join(base, "config.json")))
  named = cfg.get("dtype") or cfg.get("torch_dtype")
  if named:
    return str(named)
  table, _ = st.open_checkpoint(base)
  info = table.get("model.embed_tokens.weight") or next(iter(table.values()))
  return st.numpy_dtype(info.dtype).name


def export(workdir: str, out: str, *, step: int | None = None, overwrite: bool = False,
           dtype: str | None = None) -> int:
  """Writes the policy of `step` (default: latest) under `out`; returns the step exported."""
  _check_out(out, workdir, overwrite)
  spec = load_run_config(workdir)
  _check_not_an_input(out, spec)
  manager = _manager(workdir)
  try:
    step = pick_step(manager, step)
    mesh = make_mesh(MeshConfig())  # any mesh works: orbax reshards on restore
    with jax.set_mesh(mesh):
      model, model_config, base = restore_policy(spec.policy, manager, step, mesh)
      export_pretrained(model, model_config, out, tokenizer_dir=base, overwrite=overwrite,
                        dtype=param_dtype_of(dtype or base_dtype(base)))
  finally:
    manager.close()
  return step
