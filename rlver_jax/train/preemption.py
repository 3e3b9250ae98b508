"""SIGTERM (a TPU preemption notice, ~30 s of grace) and Ctrl-C (SIGINT) as outcomes of their own:
the last finished step is saved and the run exits with 75 or 130 (`run.outcomes`), which a retry
loop tells apart from success (0) and errors (1). A second Ctrl-C ends the process at once: a
checkpoint being written then is left as orbax's tmp folder, never as a step.

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
from rlver_jax.run.outcomes import exit_status, stopped_line
_STOP = 0  # a byte no signal number takes: tells the watcher to end
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_at_once() -> None:
  """A second Ctrl-C: the user wants out now, not after the save under way."""
  exit_stopped("interrupted again: stopped at once, without waiting for a save under way; run the "
               "same command to resume from the last saved step", signal.SIGINT)


class PreemptionGuard:
  """Turns SIGTERM (and SIGINT with `ctrl_c`) into a flag the training loop polls between turns and
  after each step; `signum` is the first signal that arrived (on any host, once `agreed` saw it).

  With `on_signal` set (before entering), the watcher thread also calls it (in a thread of its own)
  as soon as the signal arrives; the trainer saves from there and ends the process (single-process
  runs: on several hosts the save is a collective every host must reach at the same point, so they
  use the polled flag). A SIGINT after the first signal ends the process at once, wherever it is.
  """

  def __init__(self, ctrl_c: bool = False):
    # Without ctrl_c (a notebook) an interrupt stays a KeyboardInterrupt: the kernel lives on.
    self._signals = _SIGNALS if ctrl_c else (signal.SIGTERM,)
    self._event = threading.Event()
    self._previous: dict[int, object] = {}
    self._previous_fd = None
    self._pair = None
    self._watcher = None
    self._acting = None
    self.signum: int | None = None
    self.on_signal: Callable[[], None] | None = None

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self
    self._pair = socket.socketpair()
    self._pair[1].setblocking(False)  # the C handler must never block on a full buffer
    self._previous_fd = signal.set_wakeup_fd(self._pair[1].fileno(), warn_on_full_buffer=False)
    for s in self._signals:
      if s == signal.SIGINT and signal.getsignal(s) is signal.SIG_IGN:
        continue  # started in the background (`cmd &`, nohup): Ctrl-C is not meant for this run
      self._previous[s] = signal.signal(s, self._handle)
    self._watcher = threading.Thread(target=self._watch, name="sigterm-watcher", daemon=True)
    self._watcher.start()
    return self

  def _handle(self, signum, _frame) -> None:
    """The Python-level handler (main thread, when it next runs bytecode): the watcher acts first."""
    self._note(signum)

  def _note(self, signum: int) -> None:
    if self.signum is None:
      self.signum = signum
    self._event.set()

  def _watch(self) -> None:
    seen = False
    while True:
      try:
        data = self._pair[0].recv(64)
      except OSError:  # closed by __exit__
        return
      if not data or _STOP in data:  # closed, or __exit__ asked the thread to end
        return
      for signum in data:
        if signum not in self._signals:
          continue
        if seen and signum == signal.SIGINT:
          exit_at_once()
        if not seen:
          seen = True
          self._note(signum)
          if self.on_signal is not None:  # its own thread: a save may take a while, a 2nd Ctrl-C not
            self._acting = threading.Thread(target=self.on_signal, name="preemption-save", daemon=True)
            self._acting.start()

  def __exit__(self, *exc):
    if self._pair is not None:
      signal.set_wakeup_fd(self._previous_fd)
      if self._watcher.is_alive():
        self._pair[1].setblocking(True)
        self._pair[1].send(bytes([_STOP]))
        self._watcher.join(timeout=5)
      if self._acting is not None:
        self._acting.join(timeout=5)  # it may be saving (then it ends the process itself)
      for s in self._pair:
        s.close()
    for s, previous in self._previous.items():
      signal.signal(s, previous)
    return False

  @property
  def requested(self) -> bool:
    return self._event.is_set()

  def agreed(self) -> bool:
    """True on every host once any host got a signal (hosts must stop at the same step)."""
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils
    import numpy as np
    got = np.asarray(multihost_utils.process_allgather(np.int32(self.signum or 0)))
    if self.signum is None and got.any():  # another host's: every host exits with the same status
      self._note(int(got.max()))
    return bool(got.any())


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


def exit_stopped(line: str, signum: int) -> None:
  """Ends the process from any thread: sys.exit in a thread would end only that thread."""
  sys.stderr.write(line + "\n")
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(exit_status(signum))


def save_and_exit(trainer, total: int, deadline_s: float, signum: int) -> None:
  """On SIGTERM or SIGINT, from the guard's thread: saves the trainer's last recorded step (at once
  unless an update or its writes are under way: `trainer.lock`), awaits the commit up to
  `deadline_s`, ends the process with the signal's status."""
  while True:
    with trainer.lock:
      if trainer.step == trainer.recorded_step:  # else the main thread is writing that step's row
        step = trainer.step
        line = stopped_line(step, total, signum)
        if step > 0:  # step 0 is the pretrained start: nothing to keep
          line += _unsaved(trainer, step, deadline_s)
        exit_stopped(line, signum)  # holding the lock: nothing changes the state any more
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
