"""How an XLA:CPU dot's cost grows with its row count M (the decode batch), weights cached vs streamed.

One [M, 576] x [576, 1536] fp32 product (SmolLM2-135M's MLP up-projection) repeated 30 times in a
`lax.scan`: "cached" reuses one 3.5 MB weight (it stays in cache), "streamed" takes a different layer's
weight each iteration from a stacked [30, 576, 1536] array (as our decode step does). If the cached
time steps up at some M and then stays flat, the dot kernel works in row tiles of that size: a batch
that is not a multiple of the tile pays for a whole tile. The streamed GB/s is the weight bytes over
the time: what the step's dots reach against `mem_bandwidth.py`'s read bandwidth.

  python benchmarks/investigations/dot_rows.py [--rows 1,2,4,6,8,12,16,24,32] [--reps 20]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # _common, model_shapes
import _common  # noqa: F401  (JAX_PLATFORMS=cpu unless the caller set it)
import jax
import jax.numpy as jnp
import numpy as np

from _common import best_and_median, command_line, machine_info, table

LAYERS, K, N = 30, 576, 1536


def _chain(x, w):
  # Feeds each product back into the carry so no iteration can be skipped or hoisted.
  return x + jnp.dot(x, w)[:, :K] * 1e-3


@jax.jit
def cached(x, w):
  return jax.lax.scan(lambda c, _: (_chain(c, w), None), x, None, length=LAYERS)[0]


@jax.jit
def streamed(x, ws):
  return jax.lax.scan(lambda c, w: (_chain(c, w), None), x, ws)[0]


def per_dot_seconds(fn, x, w, reps: int) -> tuple[float, float]:
  jax.block_until_ready(fn(x, w))  # compile
  best, med = best_and_median(lambda: jax.block_until_ready(fn(x, w)), reps)
  return best / LAYERS, med / LAYERS


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", default="1,2,4,6,8,12,16,24,32")
  ap.add_argument("--reps", type=int, default=20)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((K, N), np.float32))
  ws = jnp.asarray(rng.standard_normal((LAYERS, K, N), np.float32))
  out = []
  for m in [int(s) for s in args.rows.split(",")]:
    x = jnp.ones((m, K), jnp.float32)
    c_best, c_med = per_dot_seconds(cached, x, w, args.reps)
    s_best, s_med = per_dot_seconds(streamed, x, ws, args.reps)
    out.append([m, f"{c_best * 1e6:.0f} ({c_med * 1e6:.0f})", f"{2 * m * K * N / c_best / 1e9:.0f}",
                f"{c_best / m * 1e6:.1f}", f"{s_best * 1e6:.0f} ({s_med * 1e6:.0f})",
                f"{K * N * 4 / s_best / 1e9:.1f}"])
  print(command_line())
  print(machine_info())
  print(table(["M", "cached us/dot best (median)", "cached GFLOP/s", "cached us per row",
               "streamed us/dot best (median)", "streamed weight GB/s"], out))


if __name__ == "__main__":
  main()
