"""Ctrl-C stops a run like a preemption (the last finished step saved, one line, status 130), a
second Ctrl-C ends it at once, and a workdir in use or not a run's is refused with one line."""
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

import tiny_world
from rlver_jax.run.checkpoint import Checkpointer

REPO = pathlib.Path(__file__).resolve().parents[2]
RESUME = "run the same command to resume"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


def _start(args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO / "tests" / "fixtures"))
  # cwd=REPO: `-m` and `-c` import this checkout's package, not an installed one.
  return subprocess.Popen([sys.executable, "-c", _FOREGROUND, *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# Ctrl-C reaches the child as it would a command run at a terminal: a test process started in the
# background ignores SIGINT, and a child inherits that (through exec too). No preexec_fn: it forks a
# multithreaded (jax) process.
_FOREGROUND = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def _lines(err: str) -> list[str]:
  return [l for l in err.strip().splitlines() if l.strip()]


def _quiet_end(proc, want_code: int, want_line=None, timeout=300) -> str:
  try:
    _, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise AssertionError(f"still running after {timeout} s: {proc.communicate()[1][-3000:]}") from None
  assert proc.returncode == want_code, err[-3000:]
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
  assert want_line is None or _lines(err)[-1] == want_line, err[-3000:]
  return err


def test_ctrl_c_saves_the_last_step_and_the_workdir_is_refused_to_others_meanwhile(world, tmp_path):
  workdir = tmp_path / "run"
  flags = tiny_world.cli_flags(world, "grpo", str(workdir), 1000, **{"checkpoint.every_steps": 1000})
  run = _start(["-m", "rlver_jax.main", *flags])
  deadline = time.time() + 300
  while not (workdir / "metrics.jsonl").exists() and time.time() < deadline and run.poll() is None:
    time.sleep(0.5)
  assert run.poll() is None, run.communicate()[1][-3000:]
  # Meanwhile: a second run on its workdir, and a run on a model's folder.
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text("{}")
  (model / "model.safetensors").write_text("")
  second = _start(["-m", "rlver_jax.main", *flags])
  foreign = _start(["-m", "rlver_jax.main", *tiny_world.cli_flags(world, "grpo", str(model), 1)])
  try:  # refused before any model loads: seconds, not a training step
    err = _quiet_end(second, 1, f"error: --workdir={workdir}: in use by another run (pid {run.pid} "
                     f"on host {socket.gethostname()}); wait for it to end or use another --workdir",
                     timeout=120)
    assert len(_lines(err)) == 1, err
    err = _quiet_end(foreign, 1, f"error: --workdir={model}: holds files but is not a run's workdir "
                     "(config.json, model.safetensors); use a new or empty directory", timeout=120)
    assert len(_lines(err)) == 1, err
  except AssertionError:
    for proc in (run, second, foreign):
      proc.kill()
    raise
  assert sorted(os.listdir(model)) == ["config.json", "model.safetensors"]
  assert run.poll() is None  # the first run goes on

  run.send_signal(signal.SIGINT)
  err = _quiet_end(run, 130)
  ckpt = Checkpointer(str(workdir), every_steps=1000, keep=3)
  step = ckpt.latest_step()
  ckpt.close()
  assert step is not None and 1 <= step < 1000  # saved although every_steps=1000 would not have
  assert _lines(err)[-1] == f"interrupted at step {step} of 1000; {RESUME}", err[-3000:]
  # The same command resumes from it (also: its workdir is taken again, the lock went with the run).
  config = tiny_world.training_config(world, "grpo", total_steps=1000,
                                      **{"checkpoint.every_steps": 1000})
  trainer = tiny_world.trainer(config, str(workdir))
  assert trainer.restore_if_any() and trainer.step == step
  trainer.checkpointer.close()


def _wait_until_caught(proc, signum, timeout=120):
  """Until the child has a handler for `signum` (its bit in SigCgt)."""
  status = pathlib.Path(f"/proc/{proc.pid}/status")
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    caught = [l for l in status.read_text().splitlines() if l.startswith("SigCgt:")]
    if caught and int(caught[0].split()[1], 16) >> (signum - 1) & 1:
      return
    time.sleep(0.005)
  raise AssertionError(f"the child never installed a handler for signal {signum}")


def test_ctrl_c_while_starting_is_one_line(world, tmp_path):
  # Within jax's import, seconds long, before the trainer's handler exists. Python catches SIGINT
  # from its start (KeyboardInterrupt); main.py's own handler is in place once it catches SIGTERM,
  # which it does right after.
  proc = _start(["-m", "rlver_jax.main", *tiny_world.cli_flags(world, "grpo", str(tmp_path), 1000)])
  _wait_until_caught(proc, signal.SIGTERM)
  proc.send_signal(signal.SIGINT)
  err = _quiet_end(proc, 130, f"interrupted while starting; {RESUME}")
  assert len(_lines(err)) == 1, err


_SLOW_SAVE = """
import time
from rlver_jax.train.preemption import PreemptionGuard
guard = PreemptionGuard(ctrl_c=True)
guard.on_signal = lambda: (print("saving", flush=True), time.sleep(600))  # a save that hangs
with guard:
  print("ready", flush=True)
  time.sleep(600)
"""


def test_a_second_ctrl_c_exits_at_once_while_the_first_one_saves():
  proc = _start(["-c", _SLOW_SAVE])
  assert proc.stdout.readline().strip() == "ready"
  proc.send_signal(signal.SIGINT)
  assert proc.stdout.readline().strip() == "saving"
  t0 = time.monotonic()
  proc.send_signal(signal.SIGINT)
  err = _quiet_end(proc, 130, "interrupted again: stopped at once, without waiting for a save under "
                   "way; run the same command to resume from the last saved step")
  assert time.monotonic() - t0 < 30 and len(_lines(err)) == 1, err
