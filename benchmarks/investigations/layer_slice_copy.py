"""What a decode step pays to read each layer's cache window out of the stacked [L, B, K, S, Dh] cache.

The decode loop runs the layers as a `lax.scan` over the stacked cache and slices each layer's window
(`CacheView._layer_window`). This times, on random data at a simulator's decode shapes (SmolLM2: 30
layers, 3 KV heads of 64, 9 query heads; batch 8; window 4k), the attention of one decode step
(q.k, softmax, p.v) over all layers three ways: (1) the scan slicing the stacked cache, as the
sampler does; (2) the same math on per-layer buffers (a Python loop over separate arrays); (3) the
other ways to reach a layer's window inside one program that do not need per-layer buffers: the
cache as the scan's xs, a `fori_loop`, the scan fully unrolled (static slices of the stack), and the
scores as a multiply-reduce instead of a dot; and, for scale, (4) one read of the whole cache
(`jnp.sum`) and (5) splitting the stacked cache into per-layer buffers (fresh arrays, as a per-call
split would allocate them).

Why the slice costs (read from the compiled HLO): XLA:CPU runs the dots and reductions as YNNPACK
library fusions, which take no dynamic-slice operand, so each layer's window is first materialized by
a loop fusion (a copy of the window, K and V) and only then read by the attention. Turning the
library fusions off (`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`) keeps a gap between (1) and
(2) and makes (2) slower; only per-layer buffers avoid the copy, and only when attention reads each
whole buffer: a static window slice of a per-layer buffer is copied too (the last two rows).

  python benchmarks/investigations/layer_slice_copy.py [--window 4096] [--batch 8] [--reps 5] [--part 0.75]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # _common, model_shapes
import _common  # noqa: F401  (JAX_PLATFORMS=cpu unless the caller set it)
import jax
import jax.numpy as jnp
import numpy as np

from _common import command_line, machine_info, table

L, K, G, DH = 30, 3, 3, 64


def best_ms(fn, *args, reps: int) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  return best * 1e3


def attend(q, k, v):
  """q [B, K, G, Dh], k/v [B, K, W, Dh] -> [B, K, G, Dh] (keys-major scores, one softmax)."""
  s = jnp.einsum("bksd,bkgd->bksg", k, q)
  p = jnp.exp(s - s.max(2, keepdims=True))
  p = p / p.sum(2, keepdims=True)
  return jnp.einsum("bksg,bksd->bkgd", p, v)


def attend_reduced(q, k, v):
  """`attend` with the scores and the weighted sum as multiply-reduce (loop fusions), not dots."""
  s = (k[:, :, :, None, :] * q[:, :, None, :, :]).sum(-1)
  p = jnp.exp(s - s.max(2, keepdims=True))
  p = p / p.sum(2, keepdims=True)
  return (p[..., None] * v[:, :, :, None, :]).sum(2)


def sliced_scan(attention, unroll: int = 1, window: int | None = None):
  """The layer scan slicing layer l's first `window` slots (all by default) out of the stacked
  cache, as `CacheView` does."""
  @jax.jit
  def run(ck, cv, q):
    _, B, K, W, Dh = ck.shape
    size = (1, B, K, window or W, Dh)
    def body(acc, l):
      k = jax.lax.dynamic_slice(ck, (l, 0, 0, 0, 0), size)[0]
      v = jax.lax.dynamic_slice(cv, (l, 0, 0, 0, 0), size)[0]
      return acc + attention(q[l], k, v).sum(), None
    return jax.lax.scan(body, jnp.float32(0), jnp.arange(L), unroll=unroll)[0]
  return run


@jax.jit
def xs_scan(ck, cv, q):
  return jax.lax.scan(lambda acc, x: (acc + attend(*x).sum(), None), jnp.float32(0), (q, ck, cv))[0]


@jax.jit
def fori(ck, cv, q):
  def body(l, acc):
    k = jax.lax.dynamic_index_in_dim(ck, l, 0, keepdims=False)
    v = jax.lax.dynamic_index_in_dim(cv, l, 0, keepdims=False)
    return acc + attend(q[l], k, v).sum()
  return jax.lax.fori_loop(0, L, body, jnp.float32(0))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--window", type=int, default=4096)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--part", type=float, default=0.75, help="the partial window, a share of --window")
  args = ap.parse_args()
  B, W = args.batch, args.window
  r = np.random.default_rng(0)
  ck = jnp.asarray(r.standard_normal((L, B, K, W, DH), np.float32))
  cv = jnp.asarray(r.standard_normal((L, B, K, W, DH), np.float32))
  q = jnp.asarray(r.standard_normal((L, B, K, G, DH), np.float32))

  scanned = sliced_scan(attend)

  @jax.jit
  def per_layer(ks, vs, q):
    return sum(attend(q[l], ks[l], vs[l]).sum() for l in range(L))

  part = int(args.part * W)  # a partial window, as a bucketed window over a partly filled cache

  @jax.jit
  def per_layer_window(ks, vs, q):
    return sum(attend(q[l], ks[l][:, :, :part], vs[l][:, :, :part]).sum() for l in range(L))

  ks, vs = [ck[l] for l in range(L)], [cv[l] for l in range(L)]
  same_data = {"the cache as the scan's xs": xs_scan, "fori_loop slicing the stacked cache": fori,
               "scan unrolled: static slices of the stacked cache": sliced_scan(attend, unroll=L),
               "scan slicing, scores as multiply-reduce (no dot)": sliced_scan(attend_reduced)}
  a = float(per_layer(ks, vs, q))
  for fn in [scanned, *same_data.values()]:  # the same attention every way
    b = float(fn(ck, cv, q))
    assert abs(a - b) <= 1e-3 * max(1.0, abs(a)), (a, b)
  split = jax.jit(lambda ck, cv: (tuple(ck[l] for l in range(L)), tuple(cv[l] for l in range(L))))
  gib = 2 * ck.nbytes / 2**30
  rows = [
      ["attention, scan slicing the stacked cache (the sampler's decode)",
       f"{best_ms(scanned, ck, cv, q, reps=args.reps):.1f}"],
      ["attention, per-layer buffers (Python loop over separate arrays)",
       f"{best_ms(per_layer, ks, vs, q, reps=args.reps):.1f}"],
      *[[name, f"{best_ms(fn, ck, cv, q, reps=args.reps):.1f}"] for name, fn in same_data.items()],
      [f"a {part}-slot window: scan slicing the stacked cache",
       f"{best_ms(sliced_scan(attend, window=part), ck, cv, q, reps=args.reps):.1f}"],
      [f"a {part}-slot window: static slices of per-layer buffers",
       f"{best_ms(per_layer_window, ks, vs, q, reps=args.reps):.1f}"],
      [f"one read of the whole cache ({gib:.2f} GiB, jnp.sum)",
       f"{best_ms(jax.jit(lambda a, b: a.sum() + b.sum()), ck, cv, reps=args.reps):.1f}"],
      ["splitting the stacked cache into per-layer buffers (fresh arrays)",
       f"{best_ms(split, ck, cv, reps=args.reps):.1f}"],
  ]
  print(f"Command: `{command_line()}`\n")
  print(machine_info() + "\n")
  print(f"{L} layers, batch {B}, window {W}, {K} KV heads x {DH}, {K * G} query heads, fp32; best of "
        f"{args.reps}\n")
  print(table(["one decode step's", "ms"], rows))


if __name__ == "__main__":
  main()
