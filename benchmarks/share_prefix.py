"""Prefix sharing on and off, side by side: `grpo_think.py:runlocal` with GRPO n = 4, the same seed,
run with `rl.share_prefix` True and False one after the other (alternating, `--repeats` times).

  python share_prefix.py [--steps=3] [--repeats=1] [--workdir=/tmp/share_prefix]

Prints, per step, prefill tokens (policy, simulator) and rollout seconds of each setting, and the
ratio off/on of the rollout seconds summed over the steps after the first (step 1 compiles).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(workdir: pathlib.Path, share: bool, steps: int) -> list[dict]:
  shutil.rmtree(workdir, ignore_errors=True)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  args = [sys.executable, "-m", "rlver_jax.main", "--config=configs/grpo_think.py:runlocal",
          f"--workdir={workdir}", f"--config.total_steps={steps}", "--config.rl.group_size=4",
          f"--config.rl.share_prefix={share}", "--config.log.progress_bar=False",
          f"--config.checkpoint.every_steps={steps}"]
  subprocess.run(args, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
  return [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--workdir", default="/tmp/share_prefix")
  a = p.parse_args()
  rows = {True: [], False: []}
  t0 = time.time()
  for _ in range(a.repeats):
    for share in (True, False):
      rows[share].append(_run(pathlib.Path(a.workdir) / f"share_{share}", share, a.steps))
  print(f"{a.repeats} x {a.steps} steps per setting, {time.time() - t0:.0f} s in all, "
        f"load average after: {os.getloadavg()[0]:.1f}")
  print("| run | step | share_prefix | policy prefill tokens | simulator prefill tokens | "
        "rollout seconds |")
  print("|---|---|---|---|---|---|")
  for r in range(a.repeats):
    for share in (True, False):
      for m in rows[share][r]:
        print(f"| {r + 1} | {m['step']} | {share} | {m['policy_prefill_tokens']:.0f} | "
              f"{m.get('simulator_prefill_tokens', float('nan')):.0f} | "
              f"{m['rollout_seconds']:.1f} |")
  late = {s: sum(m["rollout_seconds"] for run in rows[s] for m in run if m["step"] > 1)
          for s in rows}
  if late[True] > 0:
    print(f"rollout seconds of steps 2..{a.steps}: shared {late[True]:.1f}, not shared "
          f"{late[False]:.1f}, ratio not shared / shared {late[False] / late[True]:.2f}")


if __name__ == "__main__":
  sys.exit(main())
