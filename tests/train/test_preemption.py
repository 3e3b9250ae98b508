"""SIGTERM is acted on at once, wherever the main thread is, a commit wait is bounded, and a commit
that failed is named as such."""
import hashlib
import os
import signal
import threading
import time
import types

from rlver_jax.run.checkpoint import CheckpointNotSaved
from rlver_jax.train import preemption
from rlver_jax.train.preemption import PreemptionGuard, wait_with_deadline


def test_sigterm_is_seen_while_the_main_thread_is_inside_native_code():
  # One long C call that never returns to the interpreter (as a compile or a decode may not), so
  # a Python-level handler would run only after it.
  t = time.monotonic()
  hashlib.pbkdf2_hmac("sha256", b"x", b"y", 100_000)
  rounds = int(100_000 * 2.5 / max(time.monotonic() - t, 1e-3))  # about 2.5 s on this machine, now
  seen = []
  guard = PreemptionGuard()
  guard.on_signal = lambda: seen.append(time.monotonic())
  with guard:
    t0 = time.monotonic()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", rounds)
    t1 = time.monotonic()
    for _ in range(50):
      if seen:
        break
      time.sleep(0.01)
  assert guard.requested and seen, "the watcher never acted"
  assert t1 - t0 > 1.0, f"the busy call took {t1 - t0:.2f} s: too short to tell the two apart"
  assert seen[0] < t1 - 0.5, (seen[0] - t0, t1 - t0)  # during the call, not after it


def test_a_commit_wait_is_bounded():
  t0 = time.monotonic()
  assert not wait_with_deadline(lambda: time.sleep(5), 0.2)
  assert time.monotonic() - t0 < 2
  assert wait_with_deadline(lambda: None, 5)
  assert not wait_with_deadline(lambda: 1 / 0, 5)  # a failed commit is not a commit


def test_the_watcher_ends_with_the_guard():
  # Every train.run makes one; a watcher left blocked in recv would outlive its run.
  alive = lambda: [t for t in threading.enumerate() if t.name == "sigterm-watcher" and t.is_alive()]
  assert not alive()
  guard = PreemptionGuard()
  guard.on_signal = lambda: None
  with guard:
    assert len(alive()) == 1
  assert not alive()


class _Trainer:
  """What save_and_exit touches of a Trainer, with a checkpoint commit that fails as `wait` says."""

  def __init__(self, wait):
    self.lock, self.step, self.recorded_step = threading.RLock(), 3, 3
    self.checkpointer = types.SimpleNamespace(wait=wait, all_steps=lambda: [2])

  def save(self):
    pass


class _Exited(Exception):
  pass


def _exit_line(monkeypatch, trainer, deadline_s=5.0) -> str:
  def exit_stopped(line, signum):  # the real one ends the process: it never returns
    raise _Exited(line)
  monkeypatch.setattr(preemption, "exit_stopped", exit_stopped)
  try:
    preemption.save_and_exit(trainer, 5, deadline_s, signal.SIGTERM)
  except _Exited as e:
    return str(e)
  raise AssertionError("save_and_exit returned")


def test_a_failed_commit_on_sigterm_is_named_not_taken_for_a_timeout(monkeypatch):
  full = CheckpointNotSaved("disk full while saving the checkpoint of step 3 to /w/checkpoints/3 (No "
                            "space left on device); the checkpoint of step 2 is intact; free space "
                            "and run the same command to resume")
  def wait():
    raise full
  line = _exit_line(monkeypatch, _Trainer(wait))
  assert line == f"preempted at step 3 of 5; run the same command to resume ({full})"
  slow = _exit_line(monkeypatch, _Trainer(lambda: time.sleep(3)), deadline_s=0.2)
  assert slow == ("preempted at step 3 of 5; run the same command to resume (the checkpoint of step 3 "
                  "did not commit within checkpoint.preempt_deadline_s=0.2; a resume starts from step 2)")


def test_ctrl_c_is_left_to_python_unless_asked_for():
  # In a notebook an interrupt must stay a KeyboardInterrupt: the kernel lives on.
  before = signal.signal(signal.SIGINT, signal.default_int_handler)  # xdist workers ignore SIGINT
  try:
    with PreemptionGuard():
      assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with PreemptionGuard(ctrl_c=True):
      assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # Started in the background (SIGINT ignored): a Ctrl-C at the terminal is not for this run.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with PreemptionGuard(ctrl_c=True):
      assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  finally:
    signal.signal(signal.SIGINT, before)
