"""Damaged bytes inside a checkpoint (the file's length kept, so the storage layer notices nothing)
and NaN / inf in a restored array count as a damaged checkpoint: moved aside with one warning
naming the step and the array, the previous good one restored; with none left, the one-line error.
"""
import logging
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlver_jax.run import checkpoint_integrity
from rlver_jax.run.checkpoint import Checkpointer, NoRestorableCheckpoint, NonFiniteState


def _weights(step: int) -> np.ndarray:
  """Random bits as float32 (finite): what trained weights look like to a compressor, so the data
  file holds them uncompressed and a changed byte decodes without error, as in the field."""
  w = np.random.default_rng(step).integers(0, 2**32, size=(128, 128), dtype=np.uint32).view(np.float32)
  return np.where(np.isfinite(w), w, 0).astype(np.float32)


def _state(step: int, nu_scale: float = 1.0):
  return {"policy": {"w": jnp.asarray(_weights(step))},
          "policy_opt": {"nu": jnp.full((64,), nu_scale, jnp.float32), "count": jnp.int32(step)},
          "rng": jnp.asarray([step, 7], jnp.uint32)}


def _abstract():
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), _state(0))


def _saved(root: pathlib.Path, states: dict) -> pathlib.Path:
  ckpt = Checkpointer(str(root), every_steps=1, keep=5)
  for step, state in states.items():
    ckpt.save(step, state, {"step": step})
  ckpt.close()
  return root / "checkpoints"


def _damage_inside(step_dir: pathlib.Path) -> None:
  """4 KB of random bytes written into the middle of the largest data file, its length kept."""
  biggest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  data = bytearray(biggest.read_bytes())
  middle = len(data) // 2
  data[middle:middle + 4096] = np.random.default_rng(9).bytes(4096)
  biggest.write_bytes(bytes(data))
  assert biggest.stat().st_size == len(data)


def _restore(root):
  ckpt = Checkpointer(str(root), every_steps=1, keep=5)
  try:
    return ckpt.restore_newest_good(_abstract())
  finally:
    ckpt.close()


def test_damaged_bytes_in_the_newest_checkpoint_fall_back_to_the_previous_one(tmp_path, caplog):
  ckpts = _saved(tmp_path, {1: _state(1), 2: _state(2)})
  _damage_inside(ckpts / "2")
  with caplog.at_level(logging.WARNING):
    state, meta = _restore(tmp_path)
  assert meta["step"] == 1
  np.testing.assert_array_equal(state["policy"]["w"], _weights(1))
  warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warned) == 1, warned
  assert re.fullmatch(r"checkpoint of step 2 does not restore \(array policy/w differs from what was "
                      r"saved: checksum [0-9a-f]{16}, saved [0-9a-f]{16}\): moved to "
                      rf"{ckpts}/damaged/2; resuming from step 1", warned[0]), warned[0]
  assert sorted(p.name for p in ckpts.iterdir()) == ["1", "damaged"]


def test_damaged_bytes_in_every_checkpoint_are_one_error_and_nothing_moves(tmp_path):
  ckpts = _saved(tmp_path, {1: _state(1), 2: _state(2)})
  for step in (1, 2):
    _damage_inside(ckpts / str(step))
  with pytest.raises(NoRestorableCheckpoint) as e:
    _restore(tmp_path)
  assert re.fullmatch(rf"no checkpoint in {ckpts} restores \(tried steps 2, 1; step 2: array policy/w "
                      r"differs from what was saved: checksum [0-9a-f]{16}, saved [0-9a-f]{16}\); "
                      r"nothing was moved or deleted; .*", str(e.value)), str(e.value)
  assert sorted(p.name for p in ckpts.iterdir()) == ["1", "2"]


def _saved_around_the_checks(root: pathlib.Path, step: int, state, sums: dict | None) -> None:
  """A checkpoint written by orbax directly, as an older version (or another tool) would have."""
  import orbax.checkpoint as ocp
  meta = {"step": step} if sums is None else {"step": step, "checksums": sums}
  ckpt = Checkpointer(str(root), every_steps=1, keep=5)
  ckpt.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   meta=ocp.args.JsonSave(meta)))
  ckpt.close()


def test_nan_in_a_restored_optimizer_state_falls_back(tmp_path, caplog):
  """Its checksum matches (it was saved so): the finiteness check is what stops it."""
  ckpts = _saved(tmp_path, {1: _state(1)})
  nan = _state(2, nu_scale=float("nan"))
  _saved_around_the_checks(tmp_path, 2, nan, {name: [total, weighted] for name, (total, weighted, _)
                                               in checkpoint_integrity.fingerprints(nan).items()})
  with caplog.at_level(logging.WARNING):
    state, meta = _restore(tmp_path)
  assert meta["step"] == 1 and np.isfinite(np.asarray(state["policy_opt"]["nu"])).all()
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
      f"checkpoint of step 2 does not restore (array policy_opt/nu holds NaN or inf values): moved to "
      f"{ckpts}/damaged/2; resuming from step 1"]


def test_a_state_with_nan_is_not_saved(tmp_path):
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=5)
  ckpt.save(1, _state(1), {"step": 1})
  with pytest.raises(NonFiniteState) as e:
    ckpt.save(2, _state(2, nu_scale=float("inf")), {"step": 2})
  ckpt.close()
  assert str(e.value) == ("step 2: array policy_opt/nu holds NaN or inf values; not saved, the last "
                          "checkpoint holds step 1")
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]


def test_checksums_do_not_depend_on_the_sharding():
  """A checkpoint restored onto another mesh (orbax reshards) verifies against the saved sums."""
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  x = jnp.asarray(_weights(3))
  spread = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
  assert checkpoint_integrity.checksums({"w": spread}) == checkpoint_integrity.checksums({"w": x})


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (4, 1, 6, 2)])
def test_the_fingerprint_is_the_documented_sums_over_the_flat_index(shape):
  """(sum b_i, sum b_i (2i + 1)) mod 2^32 over the words b in C order, whatever the rank."""
  a = np.random.default_rng(len(shape)).normal(size=shape).astype(np.float32)
  b = a.view(np.uint32).astype(np.uint64).ravel()
  i = np.arange(b.size, dtype=np.uint64)
  want = [int(b.sum() % 2**32), int((b * (2 * i + 1)).sum() % 2**32)]
  assert checkpoint_integrity.checksums({"a": jnp.asarray(a)})["a"] == want


def test_each_word_and_its_place_count():
  """One changed word changes the first sum; two words swapped, the weighted one."""
  x = np.arange(1, 65, dtype=np.float32).reshape(8, 8)
  changed, swapped = x.copy(), x.copy()
  changed[3, 4] = np.nextafter(changed[3, 4], np.float32(np.inf))
  swapped[0, 0], swapped[7, 7] = x[7, 7], x[0, 0]
  sums = {name: checkpoint_integrity.checksums({"w": jnp.asarray(a)})["w"]
          for name, a in (("x", x), ("changed", changed), ("swapped", swapped))}
  assert sums["changed"][0] != sums["x"][0]
  assert sums["swapped"][0] == sums["x"][0] and sums["swapped"][1] != sums["x"][1]
  for dtype in (jnp.bfloat16, jnp.int8, jnp.bool_):  # narrow dtypes are widened, not rejected
    assert len(checkpoint_integrity.checksums({"w": jnp.ones((3, 5), dtype)})["w"]) == 2


def test_a_checkpoint_without_checksums_still_restores(tmp_path):
  """Checkpoints written before the checksums existed are only checked for NaN / inf."""
  _saved_around_the_checks(tmp_path, 1, _state(1), None)
  state, meta = _restore(tmp_path)
  assert meta == {"step": 1}
  np.testing.assert_array_equal(state["policy"]["w"], _weights(1))
