"""Seconds from SIGTERM to a committed checkpoint (and to the process's exit) for a real
`grpo_think.py:runlocal` run, at three points of a step:

  rollout  early in step 2's rollout (step 1 is saved then)
  compile  a resumed run, a few seconds into its first turn (its first compiles; nothing new to save)
  update   step 2's update (the save waits for the update and the step's metrics row, then saves 2)

  python preempt_latency.py [--workdir=/tmp/preempt_latency]

A checkpoint is committed when orbax has renamed its folder to checkpoints/STEP.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _start(workdir: pathlib.Path, log) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  args = [sys.executable, "-m", "rlver_jax.main", "--config=configs/grpo_think.py:runlocal",
          f"--workdir={workdir}", "--config.total_steps=100", "--config.checkpoint.every_steps=100",
          "--config.log.progress_bar=False",
          "--config.checkpoint.preempt_deadline_s=120"]  # the commit time itself, not the cut
  return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=log)


def _rows(workdir: pathlib.Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def _wait(cond, proc, timeout=1800.0, every=0.05):
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if cond():
      return True
    if proc.poll() is not None:
      return False
    time.sleep(every)
  return False


def _term_and_time(proc, workdir: pathlib.Path, expect_step: int | None) -> dict:
  t0 = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  committed = None
  folder = workdir / "checkpoints" / str(expect_step) if expect_step else None
  while proc.poll() is None:
    if committed is None and folder is not None and folder.is_dir():
      committed = time.monotonic() - t0
    time.sleep(0.02)
  if committed is None and folder is not None and folder.is_dir():
    committed = time.monotonic() - t0
  return {"exit_s": round(time.monotonic() - t0, 2), "returncode": proc.returncode,
          "committed_s": None if committed is None else round(committed, 2)}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", default="/tmp/preempt_latency")
  workdir = pathlib.Path(ap.parse_args().workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  workdir.mkdir(parents=True)
  log = open(workdir.parent / (workdir.name + ".log"), "w")
  out = {}

  proc = _start(workdir, log)
  assert _wait(lambda: len(_rows(workdir)) >= 1, proc), "the run ended before step 1"
  row1 = _rows(workdir)[0]
  time.sleep(2.0)  # into step 2's rollout
  out["rollout"] = _term_and_time(proc, workdir, 1)

  proc = _start(workdir, log)
  started = time.time()
  loaded = lambda: (workdir / "config.json").stat().st_mtime >= started  # written once models load
  assert _wait(loaded, proc), "the resumed run ended before loading"
  time.sleep(3.0)  # into the first turn: its prefill / decode programs compile now
  out["compile"] = _term_and_time(proc, workdir, 1)

  proc = _start(workdir, log)
  started = time.time()
  assert _wait(loaded, proc), "the resumed run ended before loading"
  # Step 2's update: after a rollout (step 1's, compiles included, is an upper bound) plus a bit.
  time.sleep(0.8 * row1["rollout_seconds"] + 0.5 * row1["update_seconds"])
  out["update"] = _term_and_time(proc, workdir, 2)
  out["update"]["saved_step_2"] = (workdir / "checkpoints" / "2").is_dir()
  out["step1"] = {k: round(row1[k], 1) for k in ("rollout_seconds", "update_seconds")}
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
