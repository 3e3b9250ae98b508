"""SIGTERM is acted on at once, wherever the main thread is, and a commit wait is bounded."""
import hashlib
import os
import signal
import threading
import time

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


def test_ctrl_c_is_left_to_python_unless_asked_for():
  # In a notebook an interrupt must stay a KeyboardInterrupt: the kernel lives on.
  with PreemptionGuard():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  with PreemptionGuard(ctrl_c=True):
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
