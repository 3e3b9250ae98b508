"""A resume skips damaged checkpoints: each newer one that fails is moved into checkpoints/damaged/
with a warning; when none restores, one error names the steps tried and nothing moves."""
import logging
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlver_jax.run.checkpoint import Checkpointer, NoRestorableCheckpoint


def _state(step):
  return {"w": jnp.arange(4096.0) + step, "b": jnp.full((8,), float(step))}


def _abstract():
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), _state(0))


def _saved(root, steps=(1, 2, 3)):
  ckpt = Checkpointer(str(root), every_steps=1, keep=5)
  for s in steps:
    ckpt.save(s, _state(s), {"step": s})
  ckpt.close()
  return root / "checkpoints"


def _truncate_biggest(step_dir: pathlib.Path):
  """What a full disk or a host lost mid-commit leaves: one array file cut short."""
  biggest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])


def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_next_one_restores(tmp_path, caplog):
  ckpts = _saved(tmp_path)
  _truncate_biggest(ckpts / "3")
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=5)
  with caplog.at_level(logging.WARNING):
    state, meta = ckpt.restore_newest_good(_abstract())
  assert meta["step"] == 2
  np.testing.assert_array_equal(state["w"], np.arange(4096.0) + 2)
  assert (ckpts / "damaged" / "3" / "state").is_dir() and not (ckpts / "3").exists()  # kept, not deleted
  warned = [r.getMessage() for r in caplog.records if "does not restore" in r.getMessage()]
  assert len(warned) == 1 and "step 3" in warned[0] and "resuming from step 2" in warned[0]
  # TensorStore's own words for the cut file, not the repr of the method orbax meant to call
  assert re.search(r'\(OUT_OF_RANGE reading "w/0": Requested byte range \[0, \d+\) is not valid for '
                   r"value of size \d+\)", warned[0]), warned[0]
  assert ckpt.latest_step() == 2  # the manager forgot it: the next save of step 3 is a new one
  ckpt.save(3, _state(30), {"step": 3})
  ckpt.close()
  again = Checkpointer(str(tmp_path), every_steps=1, keep=5)
  state, meta = again.restore_newest_good(_abstract())
  again.close()
  assert meta["step"] == 3 and float(state["b"][0]) == 30.0


def test_no_restorable_checkpoint_names_the_steps_and_moves_nothing(tmp_path):
  ckpts = _saved(tmp_path, steps=(1, 2))
  for s in (1, 2):
    _truncate_biggest(ckpts / str(s))
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=5)
  with pytest.raises(NoRestorableCheckpoint) as e:
    ckpt.restore_newest_good(_abstract())
  ckpt.close()
  assert re.fullmatch(
      rf'no checkpoint in {ckpts} restores \(tried steps 2, 1; step 2: OUT_OF_RANGE reading "w/0": '
      r"Requested byte range \[0, \d+\) is not valid for value of size \d+\); nothing was moved or "
      rf"deleted; to start over from step 0, move {ckpts} away \(e.g. to {ckpts}.damaged\) or pass "
      r"another --workdir", str(e.value)), str(e.value)
  assert sorted(p.name for p in ckpts.iterdir()) == ["1", "2"]


def test_no_checkpoint_at_all_is_a_fresh_start(tmp_path):
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=5)
  assert ckpt.restore_newest_good(_abstract()) is None
  ckpt.close()
