"""The trained policy of a training workdir: restore it from WORKDIR/checkpoints, export it as HF.

The run's WORKDIR/config.json says how the trainer built the policy; only the policy entry of the
checkpoint's state is read (optimizer and critic states stay on disk), straight into the shardings
of the mesh at hand.
"""
from __future__ import annotations

import json
import os

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from rlver_jax import build
from rlver_jax.models import export_pretrained, storage
from rlver_jax.models.factory import abstract_model, state_shardings
from rlver_jax.models.presets import from_hf_config, param_dtype_of
from rlver_jax.sharding import MeshConfig, make_mesh


class ExportError(ValueError):
  """Bad input for an export; the message says what to fix."""


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The run's ConfigDict from WORKDIR/config.json (written by the trainer at start)."""
  path = storage.join(workdir, "config.json")
  if not storage.exists(path):
    raise ExportError(f"{path} is missing: {workdir} is not a training workdir")
  config = json.loads(storage.read_bytes(path))
  if not isinstance(config, dict) or "rl" not in config or "policy" not in config:
    raise ExportError(f"{path} is not a training run's config (no rl / policy sections)")
  return ml_collections.ConfigDict(config)


def _manager(workdir: str) -> ocp.CheckpointManager:
  """Read-only manager over WORKDIR/checkpoints that can restore a subset of the state item."""
  directory = epath.Path(workdir) / "checkpoints"
  if not directory.exists():
    raise ExportError(f"no checkpoints under {directory}")
  options = ocp.CheckpointManagerOptions(read_only=True, create=False)
  return ocp.CheckpointManager(directory, options=options, item_handlers={
      "state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})


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


def restore_policy(config: ml_collections.ConfigDict, manager: ocp.CheckpointManager, step: int,
                   mesh: jax.sharding.Mesh):
  """(model, model config, base checkpoint dir): the policy of `step`, sharded over `mesh`.

  The target is the policy's abstract state (built like `build.load_policy`, nothing allocated);
  orbax reads only that part of the checkpoint straight into the target shardings.
  """
  path = build.resolve_checkpoint(config.policy.checkpoint, "policy.checkpoint")
  model_config = from_hf_config(json.loads(storage.read_bytes(storage.join(path, "config.json"))))
  p = config.policy
  graphdef, abstract = nnx.split(abstract_model(
      model_config, head="lm", param_dtype=param_dtype_of(p.param_dtype),
      dtype=param_dtype_of(p.compute_dtype), remat=p.remat))
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, state_shardings(abstract, mesh))
  target = {"policy": target}
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
      partial_restore=True)))
  return nnx.merge(graphdef, restored["state"]["policy"]), model_config, path


def _same_dir(a: str, b: str) -> bool:
  if storage.is_gcs(a) or storage.is_gcs(b):
    return a.rstrip("/") == b.rstrip("/")
  return os.path.abspath(a) == os.path.abspath(b)


def _check_out(out: str, workdir: str, overwrite: bool) -> None:
  if _same_dir(out, workdir) or storage.exists(storage.join(out, "checkpoints")):
    raise ExportError(f"output directory {out} is a training workdir; choose another one")
  existing = storage.list_dir(out)
  if existing and not overwrite:
    raise ExportError(f"output directory {out} is not empty ({len(existing)} entries); pass "
                      "--overwrite to write over it")


def export(workdir: str, out: str, *, step: int | None = None, overwrite: bool = False,
           dtype: str | None = None) -> int:
  """Writes the policy of `step` (default: latest) under `out`; returns the step exported."""
  _check_out(out, workdir, overwrite)
  config = load_run_config(workdir)
  manager = _manager(workdir)
  try:
    step = pick_step(manager, step)
    mesh = make_mesh(MeshConfig())  # any mesh works: orbax reshards on restore
    with jax.set_mesh(mesh):
      model, model_config, base = restore_policy(config, manager, step, mesh)
      export_pretrained(model, model_config, out, tokenizer_dir=base, overwrite=overwrite,
                        dtype=param_dtype_of(dtype or model_config.checkpoint_dtype))
  finally:
    manager.close()
  return step
