"""Orbax checkpoints under WORKDIR/checkpoints: save every N steps and at the end, keep K, resume,
and save once more on SIGTERM (a TPU preemption) before exiting.

A checkpoint holds the array state (policy / critic params and optimizer states, RNG key) and a JSON
item (step, profile-sampler state, config) so a resumed run continues exactly where it stopped.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


class Checkpointer:
  def __init__(self, workdir: str, *, every_steps: int, keep: int):
    # orbax needs an absolute path; a local workdir may be given relative to the current folder.
    root = workdir if "://" in workdir else os.path.abspath(workdir)
    self.directory = epath.Path(root) / "checkpoints"
    self.every_steps = every_steps
    # cleanup_tmp_directories: a save killed mid-commit leaves a tmp folder that rotation never
    # removes (a whole checkpoint's size, policy + critic + optimizer state).
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=True, cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def should_save(self, step: int, total_steps: int) -> bool:
    return step == total_steps or (self.every_steps > 0 and step % self.every_steps == 0)

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Asynchronous: arrays are copied off-device, then written while training continues."""
    if step in self.manager.all_steps():
      return
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restores into the shardings of `abstract_state` (ShapeDtypeStructs with `.sharding`)."""
    step = self.manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def restore_meta(self, step: int | None = None) -> dict:
    step = self.manager.latest_step() if step is None else step
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs carrying each array's sharding: the restore target for `tree`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class PreemptionGuard:
  """Turns SIGTERM into a flag the training loop polls after each step and between rollout turns
  (save the last finished step, then exit)."""

  def __init__(self):
    self._event = threading.Event()
    self._previous = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, lambda *_: self._event.set())
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
    return False

  @property
  def requested(self) -> bool:
    return self._event.is_set()

  def agreed(self) -> bool:
    """True on every host once any host got SIGTERM (hosts must stop at the same step)."""
    flag = self.requested
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      import numpy as np
      flag = bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())
    return flag
