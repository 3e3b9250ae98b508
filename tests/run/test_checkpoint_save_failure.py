"""A save that fails for lack of space is one line naming the step, its path and the checkpoint that
is still intact; the half-written step is removed, the earlier one still restores. A failure that is
not the storage's (a bug) keeps its traceback."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import full_disk
from rlver_jax.cli.errors import exit_on
from rlver_jax.run.checkpoint import Checkpointer, CheckpointNotSaved


def _state(step):
  return {"w": jnp.arange(4096.0) + step, "b": jnp.full((8,), float(step))}


def _abstract():
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), _state(0))


def test_disk_full_names_the_step_and_the_intact_checkpoint(tmp_path, monkeypatch, caplog):
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=5)
  ckpt.save(1, _state(1), {"step": 1})
  ckpt.wait()
  full_disk.fail_writes(monkeypatch)
  ckpt.save(2, _state(2), {"step": 2})  # asynchronous: its failure surfaces at the next save
  with caplog.at_level(logging.INFO), pytest.raises(CheckpointNotSaved) as e:
    ckpt.save(3, _state(3), {"step": 3})
  ckpt.close()
  path = tmp_path / "checkpoints"
  assert str(e.value) == (f"disk full while saving the checkpoint of step 2 to {path}/2 (No space "
                          "left on device); the checkpoint of step 1 is intact; free space and run "
                          "the same command to resume")
  assert sorted(p.name for p in path.iterdir()) == ["1"]  # no half-written step left behind
  loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
  assert not loud, [r.getMessage()[:200] for r in loud]  # orbax's traceback records: debug only
  monkeypatch.undo()
  again = Checkpointer(str(tmp_path), every_steps=1, keep=5)
  state, meta = again.restore_newest_good(_abstract())
  again.close()
  assert meta["step"] == 1
  np.testing.assert_array_equal(state["w"], np.arange(4096.0) + 1)


def test_disk_full_at_the_first_save_says_there_is_no_earlier_checkpoint(tmp_path, monkeypatch):
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=5)
  full_disk.fail_writes(monkeypatch)
  ckpt.save(1, _state(1), {"step": 1})
  with pytest.raises(CheckpointNotSaved) as e:
    ckpt.close()  # the last save of a run surfaces here
  assert str(e.value) == (f"disk full while saving the checkpoint of step 1 to {tmp_path}/checkpoints/1 "
                          "(No space left on device); there is no earlier checkpoint, so the run will "
                          "start over from step 0; free space and run the same command")
  assert list((tmp_path / "checkpoints").iterdir()) == []


def test_the_cli_prints_the_save_failure_as_one_line(tmp_path, monkeypatch, capsys):
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=5)
  full_disk.fail_writes(monkeypatch)
  ckpt.save(1, _state(1), {"step": 1})
  with pytest.raises(CheckpointNotSaved) as e:
    ckpt.close()
  with pytest.raises(SystemExit) as done:
    exit_on(e.value)  # what rlver_jax.main does with it
  assert done.value.code == f"error: {e.value}" and "\n" not in str(e.value)
  assert capsys.readouterr().err == ""  # no traceback above it


def test_a_failure_that_is_not_the_storage_is_raised_as_it_is(tmp_path, monkeypatch):
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=5)
  full_disk.fail_writes(monkeypatch, error=TypeError("a bug in the state given to save"))
  ckpt.save(1, _state(1), {"step": 1})
  with pytest.raises(Exception) as e:
    ckpt.close()
  assert not isinstance(e.value, CheckpointNotSaved)
  assert "a bug in the state given to save" in str(e.value)


def test_orbax_timing_our_wait_before_a_save_stays_off_the_console(tmp_path, monkeypatch, caplog):
  """Orbax warns when the wait before a save passes a threshold; the Checkpointer waits there on
  purpose (to surface the previous save's failure), so on a busy host that warning fired on every
  save (the CI flake of test_disk_full_names_the_step_and_the_intact_checkpoint)."""
  from orbax.checkpoint import checkpoint_manager
  monkeypatch.setattr(checkpoint_manager, "_WAIT_FOR_PREV_SAVE_WARNING_THRESHOLD_SECS", -1.0)
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=5)
  with caplog.at_level(logging.DEBUG):
    for step in (1, 2, 3):
      ckpt.save(step, _state(step), {"step": step})
    ckpt.close()
  waits = [r for r in caplog.records if r.getMessage().startswith("Waiting for previous save")]
  assert waits and all(r.levelno == logging.DEBUG for r in waits), [(r.levelname, r.getMessage()) for r in waits]
