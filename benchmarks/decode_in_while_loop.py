"""Whether a decode step loses its in-place weight reads once it runs inside an on-device loop.

On XLA:GPU static slices of the stacked [L, ...] weights feed their GEMMs without a copy (5.6 ms for
a 7B step) while the layer scan copies each slice (12.5 ms; `results_gpu.md`, 2026-12-04); the
sampler with static slices still took 11.2 ms. The sampler differs in one way: its tokens come from a
`lax.while_loop` whose state holds the params. This times one token per call four ways:

  host loop, static slices   one jitted step per token (the 5.6 ms case)
  fori_loop, static slices   `--tokens` steps in one `lax.fori_loop`, params closed over
  fori_loop, params carried  the same with the params in the loop state, as the sampler does
  fori_loop, layer scan      the model's scan inside the loop

Random weights (model_shapes.py), batch `--batch`, a fixed `--window`-slot cache window (not written:
the weight reads are the question); medians of `--reps` calls.

  JAX_PLATFORMS=cuda python benchmarks/decode_in_while_loop.py --model qwen2.5-7b:bfloat16
  python benchmarks/decode_in_while_loop.py --model smollm2-135m:float32 --reps 3
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _common, model_shapes
import _common  # noqa: F401  (JAX_PLATFORMS=cpu unless the caller set it)
import jax
import jax.numpy as jnp
from flax import nnx

from _common import command_line, machine_info, median, table, timed
from model_shapes import shape_config
from rlver_jax.models import create_model
from rlver_jax.models import qwen2


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="smollm2-135m:float32", help="SHAPE:DTYPE (model_shapes.py)")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--window", type=int, default=1024)
  ap.add_argument("--tokens", type=int, default=16, help="steps per call of the looped ways")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--ways", default="host,closed,carried,scan")
  args = ap.parse_args()
  shape, dtype_name = args.model.split(":")
  c, dtype = shape_config(shape), jnp.dtype(dtype_name)
  model = create_model(c, param_dtype=dtype, dtype=dtype)
  stacked = {k: v[...] for k, v in vars(model.layers).items() if isinstance(v, nnx.Param)}
  embed, final_norm = model.embed[...], model.final_norm[...]
  B, W, N = args.batch, args.window, args.tokens
  cache_shape = (c.num_layers, B, c.num_kv_heads, W, c.head_dim)
  ck, cv = (jax.random.normal(jax.random.key(i), cache_shape, jnp.float32).astype(dtype)
            for i in (1, 2))
  positions = jnp.full((B, 1), W, jnp.int32)
  masks = qwen2.BlockMask.over_cache_and_tokens(jnp.ones((B, 1, W), bool), jnp.ones((B, 1, 1), bool))
  block = functools.partial(qwen2._block, config=c, dtype=dtype)

  def step_static(stacked, ck, cv, embed, final_norm, tokens):
    cos, sin = qwen2.rope_tables(positions, c.head_dim, c.rope_theta)
    h = jnp.take(embed, tokens, axis=0).astype(dtype)
    for l in range(c.num_layers):
      h, _ = block(h, {k: v[l] for k, v in stacked.items()}, cos, sin, masks, (ck[l], cv[l]))
    h = qwen2.rms_norm(h, final_norm, c.rms_norm_eps)
    return jnp.argmax(jnp.einsum("btd,vd->btv", h, embed.astype(dtype)), -1).astype(jnp.int32)

  def step_scan(stacked, ck, cv, embed, final_norm, tokens):
    cos, sin = qwen2.rope_tables(positions, c.head_dim, c.rope_theta)

    def body(h, p_l):
      p, l = p_l
      return block(h, p, cos, sin, masks, (ck[l], cv[l]))[0], None
    h, _ = jax.lax.scan(body, jnp.take(embed, tokens, axis=0).astype(dtype),
                        (stacked, jnp.arange(c.num_layers)))
    h = qwen2.rms_norm(h, final_norm, c.rms_norm_eps)
    return jnp.argmax(jnp.einsum("btd,vd->btv", h, embed.astype(dtype)), -1).astype(jnp.int32)

  host = jax.jit(step_static)

  def looped(step, carry_params):
    @jax.jit
    def run(stacked, ck, cv, embed, final_norm, tokens):
      if carry_params:
        def body(_, state):
          params, toks = state
          return params, step(*params, toks)
        return jax.lax.fori_loop(0, N, body, ((stacked, ck, cv, embed, final_norm), tokens))[1]
      return jax.lax.fori_loop(0, N, lambda _, t: step(stacked, ck, cv, embed, final_norm, t), tokens)
    return run

  ways = {"host": ("host loop, static slices", None),
          "closed": ("fori_loop, static slices, params closed over", looped(step_static, False)),
          "carried": ("fori_loop, static slices, params carried", looped(step_static, True)),
          "scan": ("fori_loop, layer scan", looped(step_scan, False))}
  chosen = [w for w in args.ways.split(",") if w in ways]
  tokens0 = (jnp.arange(B, dtype=jnp.int32)[:, None] + 5)
  rest = (stacked, ck, cv, embed, final_norm)

  def per_token(way):
    if way == "host":
      def call():
        t = tokens0
        for _ in range(N):
          t = host(*rest, t)
        return jax.block_until_ready(t)
    else:
      def call():
        return jax.block_until_ready(ways[way][1](*rest, tokens0))
    return call

  rows, firsts, outs = [], {}, {}
  nbytes = sum(x.nbytes for x in jax.tree.leaves(stacked))
  for way in chosen:
    call = per_token(way)
    outs[way], firsts[way] = timed(call)
    print(f"{way}: first call {firsts[way]:.1f} s", file=sys.stderr, flush=True)
    t = median([timed(call)[1] for _ in range(args.reps)]) / N
    rows.append([ways[way][0], f"{t * 1e3:.2f}", f"{nbytes / t / 1e9:.0f}", f"{firsts[way]:.1f}"])
    print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
  same = all(bool((outs[w] == outs[chosen[0]]).all()) for w in chosen)
  print(f"Command: `{command_line()}`\n")
  print(machine_info() + "\n")
  print(f"{shape} {dtype.name}, batch {B}, window {W}, {c.num_layers} layers ({nbytes / 2**20:.0f} MiB "
        f"of layer weights), {N} tokens per call, medians of {args.reps}; same tokens: {same}.\n")
  print(table(["way", "ms per token", "layer weights / time, GB/s", "first call s"], rows))


if __name__ == "__main__":
  main()
