"""One decode step of the model's own decoder block two ways: a `lax.scan` over the stacked [L, ...]
params (what the model runs; XLA:CPU and XLA:GPU copy each layer's weight slice out of the stack every
step), a Python loop over per-layer weight buffers (no slice to copy, a program L times longer), and
the same loop over static slices of the stacked params (whether a static slice is copied too).

Random weights of a named shape (model_shapes.py), batch `--batch`, one new token per row attending a
`--window`-slot cache window; medians of `--reps` calls, the two ways interleaved.

  python benchmarks/investigations/layer_scan_vs_loop.py --model smollm2-135m:float32
  JAX_PLATFORMS=cuda python benchmarks/investigations/layer_scan_vs_loop.py --model qwen2.5-7b:bfloat16 --window 1024
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # _common, model_shapes
import _common  # noqa: F401  (JAX_PLATFORMS=cpu unless the caller set it)
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _common import command_line, machine_info, median, table, timed
from model_shapes import shape_config
from rlver_jax.models import create_model
from rlver_jax.models import qwen2


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="smollm2-135m:float32", help="SHAPE:DTYPE (model_shapes.py)")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--window", type=int, default=128)
  ap.add_argument("--reps", type=int, default=30)
  args = ap.parse_args()
  shape, dtype_name = args.model.split(":")
  c, dtype = shape_config(shape), jnp.dtype(dtype_name)
  model = create_model(c, param_dtype=dtype, dtype=dtype)
  stacked = {k: v[...] for k, v in vars(model.layers).items() if isinstance(v, nnx.Param)}
  per_layer = [{k: jnp.array(v[l]) for k, v in stacked.items()} for l in range(c.num_layers)]
  embed, final_norm = model.embed[...], model.final_norm[...]
  B, W = args.batch, args.window
  cache_shape = (c.num_layers, B, c.num_kv_heads, W, c.head_dim)
  ck, cv = (jax.random.normal(jax.random.key(i), cache_shape, jnp.float32).astype(dtype) for i in (1, 2))
  tokens = jnp.arange(B, dtype=jnp.int32)[:, None] + 5
  positions = jnp.full((B, 1), W, jnp.int32)
  masks = qwen2.BlockMask.over_cache_and_tokens(jnp.ones((B, 1, W), bool), jnp.ones((B, 1, 1), bool))
  block = functools.partial(qwen2._block, config=c, dtype=dtype)

  def next_tokens(h, embed, final_norm):  # arguments, not closed-over constants XLA would fold
    h = qwen2.rms_norm(h, final_norm, c.rms_norm_eps)
    return jnp.argmax(jnp.einsum("btd,vd->btv", h, embed.astype(dtype)), -1)

  @jax.jit
  def scanned(stacked, *rest):
    cos, sin = qwen2.rope_tables(positions, c.head_dim, c.rope_theta)

    def body(h, p_l):
      p, l = p_l
      return block(h, p, cos, sin, masks, (ck[l], cv[l]))
    h, kv = jax.lax.scan(body, jnp.take(embed, tokens, axis=0).astype(dtype),
                         (stacked, jnp.arange(c.num_layers)))
    return next_tokens(h, embed, final_norm), kv

  @jax.jit
  def looped(per_layer, *rest):
    cos, sin = qwen2.rope_tables(positions, c.head_dim, c.rope_theta)
    h, kvs = jnp.take(embed, tokens, axis=0).astype(dtype), []
    for l, p in enumerate(per_layer):
      h, kv = block(h, p, cos, sin, masks, (ck[l], cv[l]))
      kvs.append(kv)
    return next_tokens(h, embed, final_norm), kvs

  @jax.jit
  def static_sliced(stacked, *rest):  # does a static slice of the stack copy?
    return looped([{k: v[l] for k, v in stacked.items()} for l in range(c.num_layers)], *rest)

  rest = (ck, cv, embed, final_norm)
  firsts = {}  # each way's first call (its compile), reported: an unrolled 28-layer program is slow to build
  for name, fn, params in (("scan", scanned, stacked), ("per-layer", looped, per_layer),
                           ("static slices", static_sliced, stacked)):
    out, firsts[name] = timed(lambda: jax.block_until_ready(fn(params, *rest)))
    print(f"{name}: first call {firsts[name]:.1f} s", file=sys.stderr, flush=True)
  a, b, d = scanned(stacked, *rest), looped(per_layer, *rest), static_sliced(stacked, *rest)
  same = bool((a[0] == b[0]).all()) and bool((a[0] == d[0]).all())
  t_scan, t_loop, t_static = [], [], []
  for _ in range(args.reps):
    t_scan.append(timed(lambda: jax.block_until_ready(scanned(stacked, *rest)))[1])
    t_loop.append(timed(lambda: jax.block_until_ready(looped(per_layer, *rest)))[1])
    t_static.append(timed(lambda: jax.block_until_ready(static_sliced(stacked, *rest)))[1])
  nbytes = sum(x.nbytes for x in jax.tree.leaves(stacked))
  s, l, st = median(t_scan), median(t_loop), median(t_static)
  print(f"Command: `{command_line()}`\n")
  print(machine_info() + "\n")
  print(f"{shape} {dtype.name}, batch {B}, window {W}, {c.num_layers} layers ({nbytes / 2**20:.0f} MiB of "
        f"layer weights), medians of {args.reps} interleaved calls; same next tokens: {same}; first calls "
        f"(compile) {', '.join(f'{k} {v:.1f} s' for k, v in firsts.items())}.\n")
  print(table(["layers as", "ms per step", "layer weights / time, GB/s", "vs scan"],
              [["lax.scan over stacked params", f"{s * 1e3:.2f}", f"{nbytes / s / 1e9:.1f}", "1.00x"],
               ["loop over per-layer buffers", f"{l * 1e3:.2f}", f"{nbytes / l / 1e9:.1f}",
                f"{s / l:.2f}x"],
               ["loop over static slices of the stack", f"{st * 1e3:.2f}", f"{nbytes / st / 1e9:.1f}",
                f"{s / st:.2f}x"]]))


if __name__ == "__main__":
  main()
