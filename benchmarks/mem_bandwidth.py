"""What this CPU can do right now: memory bandwidth (numpy, 1 GiB) and fp32 matmul throughput.

Gives the floor for a decode step of SmolLM2-135M in fp32: every step reads all ~540 MB of weights
(the tied 49152 x 576 LM head included), so step time >= weight bytes / read bandwidth.

  python benchmarks/mem_bandwidth.py [--gib 1] [--reps 5]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import _common  # noqa: F401
from _common import command_line, machine_info, median, table

SMOL_PARAMS = 134_515_008  # SmolLM2-135M (tied embeddings)


def best_and_median(fn, reps: int) -> tuple[float, float]:
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return min(ts), median(ts)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--gib", type=float, default=1.0)
  ap.add_argument("--reps", type=int, default=5)
  args = ap.parse_args()
  n = int(args.gib * 2**30 // 4)
  a = np.ones(n, np.float32)
  b = np.empty_like(a)
  np.copyto(b, a)
  rows = []
  best, med = best_and_median(lambda: np.copyto(b, a), args.reps)
  rows.append(["numpy copy (read + write), GB/s", f"{2 * a.nbytes / best / 1e9:.1f}",
               f"{2 * a.nbytes / med / 1e9:.1f}"])
  best, med = best_and_median(lambda: a.sum(), args.reps)
  read_best = a.nbytes / best
  rows.append(["numpy sum (read), GB/s", f"{read_best / 1e9:.1f}", f"{a.nbytes / med / 1e9:.1f}"])
  del a, b
  rng = np.random.default_rng(0)
  for m in (8, 2048):
    x = rng.standard_normal((m, 576), np.float32)
    w = rng.standard_normal((576, 1536), np.float32)
    best, med = best_and_median(lambda: x @ w, args.reps * 4)
    flop = 2 * m * 576 * 1536
    rows.append([f"fp32 matmul [{m}, 576] x [576, 1536], GFLOP/s", f"{flop / best / 1e9:.1f}",
                 f"{flop / med / 1e9:.1f}"])
  weights = SMOL_PARAMS * 4
  print(f"Command: `{command_line()}`\n")
  print(machine_info() + "\n")
  print(table(["measure", "best", "median"], rows))
  print(f"\nSmolLM2-135M fp32 weights: {weights / 1e6:.0f} MB -> decode step floor at the best read "
        f"bandwidth: {weights / read_best * 1e3:.0f} ms, i.e. at most {8 * read_best / weights:.0f} "
        f"tokens/s at batch 8.")


if __name__ == "__main__":
  main()
