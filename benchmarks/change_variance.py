"""Std of one dialogue's reward over repeated simulator runs: sampled vs expected changes.

One demo profile, fixed policy replies; the dialogue is played by `--runs` rows of one batch (each
row samples its own analysis: independent simulator runs), once per `simulator.change_mode`, with
the embedded SmolLM2-135M as the simulator (or `--checkpoint`). Reports per mode the reward mean and
std over the runs and the share of emotion steps whose change line could be read (an unread one
counts as no change in both modes).

  cd benchmarks && python change_variance.py --runs 8 --max_new_tokens 96
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from rlver_jax import build
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.spec import SimulatorSpec

REPLIES = ["That sounds really hard. I'm here, tell me more about what happened.",
           "It makes sense that you feel this way; what would help you most right now?"]


def run(mode: str, args) -> tuple[np.ndarray, float, float]:
  spec = SimulatorSpec(checkpoint=args.checkpoint, dtype="float32", max_context=3072,
                       max_new_tokens=args.max_new_tokens, max_parse_retries=0,
                       score_guidance=True, change_mode=mode)
  backend = build.simulator_backend(spec, None, seed=args.seed)
  backend.reseed(jax.random.key(args.seed))
  profile = load_demo_profiles()[args.profile]
  users = SimulatedUsers([profile] * args.runs, backend, max_turns=len(REPLIES), max_parse_retries=0,
                         score_guidance=True, change_mode=mode)
  t0 = time.perf_counter()
  users.opening()
  for reply in REPLIES:
    rows = users.live_rows()
    if rows:
      users.step(rows, [reply] * len(rows))
  parsed = [p for rec in users.records for p in rec.parsed]
  return np.array(users.rewards()), float(np.mean(parsed)), time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--runs", type=int, default=8)
  ap.add_argument("--max_new_tokens", type=int, default=96)
  ap.add_argument("--profile", type=int, default=0)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--checkpoint", default="embedded")
  args = ap.parse_args()
  for mode in ("sampled", "expected"):
    rewards, read, seconds = run(mode, args)
    print(f"{mode:8s} reward mean {rewards.mean():.4f} std {rewards.std(ddof=1):.4f} over "
          f"{args.runs} runs; change lines read {read:.0%}; {seconds:.0f} s; rewards "
          f"{np.round(rewards, 3).tolist()}", flush=True)


if __name__ == "__main__":
  main()
