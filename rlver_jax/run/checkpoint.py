"""Orbax checkpoints under WORKDIR/checkpoints: save every N steps and at the end, keep K, resume
from the newest one that restores (damaged newer ones are moved into checkpoints/damaged/). A save
that fails (a full disk) is one CheckpointNotSaved line naming the step and the intact one before.

A checkpoint holds the array state (policy / critic params and optimizer states, RNG key) and a JSON
item (step, profile-sampler state, config, each array's checksum) so a resumed run continues exactly
where it stopped. A restore checks the checksums and that every float array is finite
(`checkpoint_integrity`): damaged bytes count as a damaged checkpoint.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from rlver_jax.parallel.process_zero import on_process_zero
from rlver_jax.run import checkpoint_integrity, library_noise
from rlver_jax.run.checkpoint_errors import (CheckpointNotSaved, NoRestorableCheckpoint,
                                             NonFiniteState, describe, is_storage_error,
                                             no_restorable_line, not_saved_line)

__all__ = ["Checkpointer", "CheckpointNotSaved", "NoRestorableCheckpoint", "NonFiniteState",
           "abstract_like"]


def checkpoint_folder(workdir: str) -> epath.Path:
  """WORKDIR/checkpoints, absolute (orbax needs it; a local workdir may be given relative)."""
  root = workdir if "://" in workdir else os.path.abspath(workdir)
  return epath.Path(root) / "checkpoints"


def open_manager(workdir: str, *, keep: int | None = None) -> ocp.CheckpointManager:
  """The one way a checkpoint folder is opened: the trainer's writer (`keep` checkpoints kept) or,
  with `keep` None, a read-only reader that can restore part of the state item (the policy alone:
  export, generate, evaluations of a workdir). Its items: "state" (arrays), "meta" (JSON)."""
  directory = checkpoint_folder(workdir)
  if keep is None:
    # save_interval_steps=0: what read_only implies anyway (orbax warns when it has to set it).
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
  # cleanup_tmp_directories: a save killed mid-commit leaves a tmp folder that rotation never
  # removes (a whole checkpoint's size, policy + critic + optimizer state).
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                         enable_async_checkpointing=True, cleanup_tmp_directories=True)
  return ocp.CheckpointManager(directory, options=options, item_names=("state", "meta"))


class Checkpointer:
  def __init__(self, workdir: str, *, every_steps: int, keep: int):
    self.directory = checkpoint_folder(workdir)
    self.every_steps = every_steps
    with library_noise.reading_checkpoints():  # it reads each step's metadata, maybe damaged
      self.manager = open_manager(workdir, keep=keep)
    self._in_flight: int | None = None  # the step of an async save not yet known to have committed
    library_noise.demote_library_tracebacks()

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def should_save(self, step: int, total_steps: int) -> bool:
    return step == total_steps or (self.every_steps > 0 and step % self.every_steps == 0)

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Asynchronous: arrays are copied off-device, then written while training continues. A failure
    of the previous save surfaces here (or in wait/close), as CheckpointNotSaved for its step."""
    self.wait()
    if step in self.manager.all_steps():
      return
    # Before the save starts copying: the arrays are not donated until the next update.
    try:
      sums = checkpoint_integrity.checksums(state)
    except NonFiniteState as e:
      saved = self.manager.latest_step()
      raise NonFiniteState(f"step {step}: {e}; not saved, the last checkpoint holds "
                           f"{'nothing yet' if saved is None else f'step {saved}'}") from None
    meta = {**meta, checkpoint_integrity.CHECKSUMS: sums}
    self._in_flight = step
    try:
      self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)), force=True)
    except Exception as e:
      self._raise_not_saved(e)

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restores into the shardings of `abstract_state` (ShapeDtypeStructs with `.sharding`); raises
    DamagedCheckpoint if an array differs from what was saved or is not finite."""
    step = self.manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    meta = dict(out["meta"])
    checkpoint_integrity.verify(out["state"], meta.pop(checkpoint_integrity.CHECKSUMS, None))
    return out["state"], meta  # the caller's meta, as it was saved

  def restore_newest_good(self, abstract_state: Any) -> tuple[Any, dict] | None:
    """The newest checkpoint that restores completely (None when there is none at all).

    A newer one that fails (a file cut short by a full disk or a host lost mid-commit, bytes changed
    on storage, NaN / inf in an array) is moved into
    checkpoints/damaged/ with one warning line each, never deleted. If none restores, nothing is
    moved and NoRestorableCheckpoint names the steps tried and what to do.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    failed: list[tuple[int, str]] = []
    for step in steps:
      try:
        with library_noise.reading_checkpoints():
          state, meta = self.restore(abstract_state, step)
      except Exception as e:  # orbax / tensorstore raise many kinds for a damaged file
        logging.debug("restoring step %d", step, exc_info=e)
        failed.append((step, describe(e)))
        continue
      if failed:  # the exceptions are gone: what their reads left is collected under the filters
        library_noise.collect_restore_debris()
      for bad, why in failed:
        moved = on_process_zero(f"moving checkpoint {bad} aside", lambda: self._move_aside(bad))
        logging.warning("checkpoint of step %d does not restore (%s): moved to %s; resuming from "
                        "step %d", bad, why, moved or "checkpoints/damaged/", step)
      if failed:
        self._sync("rlver_jax:damaged_moved")
        self.manager.reload()
      return state, meta
    if not failed:
      return None
    library_noise.collect_restore_debris()
    raise NoRestorableCheckpoint(no_restorable_line(str(self.directory), failed))

  def _move_aside(self, step: int) -> epath.Path:
    damaged = self.directory / "damaged"
    damaged.mkdir(parents=True, exist_ok=True)
    target = damaged / str(step)
    n = 2
    while target.exists():  # a step damaged twice (an earlier run's copy): keep both
      target, n = damaged / f"{step}-{n}", n + 1
    (self.directory / str(step)).rename(target)
    return target

  @staticmethod
  def _sync(name: str) -> None:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(name)

  def restore_meta(self, step: int | None = None) -> dict:
    step = self.manager.latest_step() if step is None else step
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def wait(self) -> None:
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      self._raise_not_saved(e)
    self._in_flight = None

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()

  def _raise_not_saved(self, e: Exception) -> None:
    """Re-raises `e` as one CheckpointNotSaved line if the storage failed (else as it is: a bug),
    after removing the half-written step so nothing takes it for a checkpoint."""
    step, self._in_flight = self._in_flight, None
    if step is None or not is_storage_error(e):
      raise e
    if jax.process_index() == 0:
      self._remove_partial(step)
    earlier = max((s for s in self.manager.all_steps() if s != step), default=None)
    raise CheckpointNotSaved(not_saved_line(step, str(self.directory / str(step)), e, earlier)) from e

  def _remove_partial(self, step: int) -> None:
    for path in [self.directory / str(step), *self.directory.glob(f"{step}.orbax-checkpoint-tmp*")]:
      try:
        if path.exists():
          path.rmtree()
      except OSError as e:  # orbax's cleanup_tmp_directories retries at the next start
        logging.warning("could not remove the partial checkpoint %s: %s", path, e)


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs carrying each array's sharding: the restore target for `tree`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

