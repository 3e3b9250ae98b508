"""`export` and the evaluations that read a training workdir's policy check the checksums saved with
its checkpoint: damaged bytes are one line naming the step, the array and the other steps, and the
workdir is left as it was (a reader moves nothing)."""
import dataclasses
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny_world
from rlver_jax.parallel.sharding import MeshConfig, make_mesh
from rlver_jax.run import trained_policy

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import base  # noqa: E402


def _damage_array(step_dir: pathlib.Path, values: np.ndarray) -> None:
  """Random bytes written over the middle of one array's stored bytes, the file's length kept (the
  data files hold several arrays: hitting a frame header would be a read error, not this case)."""
  raw = values.tobytes()
  needle = raw[len(raw) // 2:len(raw) // 2 + 32]
  for f in (p for p in (step_dir / "state").rglob("*") if p.is_file()):
    data = bytearray(f.read_bytes())
    at = data.find(needle)
    if at >= 0:
      data[at:at + 256] = np.random.default_rng(9).bytes(256)
      f.write_bytes(bytes(data))
      return
  raise AssertionError(f"the array's bytes are not stored verbatim under {step_dir}")


def _random_bits(x, seed):
  """Finite float32 of random bits: stored uncompressed, so damaged bytes decode without error."""
  bits = np.random.default_rng(seed).integers(0, 2**32, size=x.shape, dtype=np.uint32).view(np.float32)
  return jax.device_put(jnp.asarray(np.where(np.isfinite(bits), bits, 0), x.dtype), x.sharding)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A tiny run's workdir with checkpoints of steps 1 and 2 (saved directly: no step is trained)."""
  root = tmp_path_factory.mktemp("trained")
  config = base.get_base_config("grpo", think=False, arg=None)
  tiny_world.apply(config, tiny_world.tiny_overrides(tiny_world.make_world(root / "world"), "grpo"))
  trainer = tiny_world.trainer(config, str(root / "run"))
  for step in (1, 2):
    trainer.state = dataclasses.replace(
        trainer.state, policy=jax.tree.map(lambda x: _random_bits(x, step), trainer.state.policy))
    trainer.step = step
    trainer.save()
  trainer.checkpointer.close()
  trainer.writer.close()
  biggest = max(jax.tree.leaves(trainer.state.policy), key=lambda x: x.size)
  _damage_array(root / "run" / "checkpoints" / "2", np.asarray(biggest))
  return root / "run"


def test_export_of_a_damaged_checkpoint_is_one_line_naming_the_step_and_the_array(workdir, tmp_path):
  before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  with pytest.raises(trained_policy.ExportError) as e:
    trained_policy.export(str(workdir), str(tmp_path / "out"))
  assert re.fullmatch(rf"the checkpoint of step 2 in {workdir}/checkpoints does not restore \(array "
                      r"policy/[\w/]+ differs from what was saved: checksum [0-9a-f]{16}, saved "
                      r"[0-9a-f]{16}\); pass --step=1 for the newest other one \(steps 1\)",
                      str(e.value)), str(e.value)
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before  # nothing moved
  assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_policy_of_an_intact_step_loads(workdir):
  mesh = make_mesh(MeshConfig())
  with jax.set_mesh(mesh):
    _, _, step, _ = trained_policy.load_trained(str(workdir), 1, mesh)
  assert step == 1
