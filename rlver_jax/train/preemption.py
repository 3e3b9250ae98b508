"""SIGTERM (a TPU preemption notice, ~30 s of grace) as its own outcome: the last finished step is
saved and the run exits with PREEMPTED_EXIT, which a retry loop tells apart from success (0) and
errors (1).

Python runs a signal handler only when the main thread returns to the interpreter, which a long
jitted decode or a first compile after a resume delays by minutes at 7B. So the handler's C part
also writes to a wakeup fd that a watcher thread reads: it acts at once, wherever the main thread is.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

import jax

from rlver_jax.run.checkpoint_errors import CheckpointNotSaved, describe

# EX_TEMPFAIL (sysexits.h): "try again later", what a retry loop should do.
PREEMPTED_EXIT = 75
_STOP = 0  # a byte no signal number takes: tells the watcher to end


def preempted_line(step: int, total: int) -> str:
  return f"preempted at step {step} of {total}; run the same command to resume"


class PreemptionGuard:
  """Turns SIGTERM into a flag the training loop polls between turns and after each step.

  With `on_signal` set (before entering), the watcher thread also calls it as soon as the signal
  arrives; the trainer saves from there and ends the process (single-process runs: on several hosts
  the save is a collective every host must reach at the same point, so they use the polled flag).
  """

  def __init__(self):
    self._event = threading.Event()
    self._previous = None
    self._previous_fd = None
    self._pair = None
    self.on_signal: Callable[[], None] | None = None

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self
    self._previous = signal.signal(signal.SIGTERM, lambda *_: self._event.set())
    if self.on_signal is not None:
      self._pair = socket.socketpair()
      self._pair[1].setblocking(False)  # the C handler must never block on a full buffer
      self._previous_fd = signal.set_wakeup_fd(self._pair[1].fileno(), warn_on_full_buffer=False)
      self._watcher = threading.Thread(target=self._watch, name="sigterm-watcher", daemon=True)
      self._watcher.start()
    return self

  def _watch(self) -> None:
    while True:
      try:
        data = self._pair[0].recv(64)
      except OSError:  # closed by __exit__
        return
      if not data or _STOP in data:  # closed, or __exit__ asked the thread to end
        return
      if signal.SIGTERM in data:
        self._event.set()
        self.on_signal()
        return

  def __exit__(self, *exc):
    if self._pair is not None:
      signal.set_wakeup_fd(self._previous_fd)
      if self._watcher.is_alive():
        self._pair[1].setblocking(True)
        self._pair[1].send(bytes([_STOP]))
        self._watcher.join(timeout=5)  # it may be saving (then it ends the process itself)
      for s in self._pair:
        s.close()
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


def wait_with_deadline(wait: Callable[[], None], deadline_s: float,
                       errors: list[BaseException] | None = None) -> bool:
  """Runs `wait` (e.g. orbax's wait_until_finished) for at most `deadline_s`; True if it returned.
  What it raised, if anything, is appended to `errors`."""
  done = threading.Event()
  errors = [] if errors is None else errors

  def run():
    try:
      wait()
    except BaseException as e:  # reported by the caller's line, not as a thread traceback
      errors.append(e)
    finally:
      done.set()
  threading.Thread(target=run, name="commit-wait", daemon=True).start()
  return done.wait(deadline_s) and not errors


def exit_preempted(line: str) -> None:
  """Ends the process from any thread: sys.exit in a thread would end only that thread."""
  sys.stderr.write(line + "\n")
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(PREEMPTED_EXIT)


def save_and_exit(trainer, total: int, deadline_s: float) -> None:
  """On SIGTERM, from the watcher thread: saves the trainer's last recorded step (at once unless an
  update or its writes are under way: `trainer.lock`), awaits the commit up to `deadline_s`, ends
  the process with PREEMPTED_EXIT."""
  while True:
    with trainer.lock:
      if trainer.step == trainer.recorded_step:  # else the main thread is writing that step's row
        step = trainer.step
        line = preempted_line(step, total)
        if step > 0:  # step 0 is the pretrained start: nothing to keep
          line += _unsaved(trainer, step, deadline_s)
        exit_preempted(line)  # holding the lock: nothing changes the state any more
    time.sleep(0.02)


def _unsaved(trainer, step: int, deadline_s: float) -> str:
  """"" once the checkpoint of `step` committed, else why not and where a resume starts."""
  errors: list[BaseException] = []
  try:
    trainer.save()  # also where an earlier save's failure surfaces
    if wait_with_deadline(trainer.checkpointer.wait, deadline_s, errors):
      return ""
  except CheckpointNotSaved as e:
    errors.append(e)
  if errors and isinstance(errors[0], CheckpointNotSaved):  # already says what is intact
    return f" ({errors[0]})"
  kept = max((s for s in trainer.checkpointer.all_steps() if s != step), default=0)
  why = (f"failed: {describe(errors[0])}" if errors else
         f"did not commit within checkpoint.preempt_deadline_s={deadline_s:g}")
  return f" (the checkpoint of step {step} {why}; a resume starts from step {kept})"
