"""Where one decode step's time goes: our sampler's step vs the same step's dots alone, per backend.

For each model shape (random weights, batch `--batch`): our decode step time (from two decode lengths,
so prefill and the fixed per-call cost cancel), the step's weight-streaming dots on their own in a
`lax.scan` over stacked layers (as our model runs them) and unrolled over per-layer arrays, and a plain
read of a large array. Weight bytes / time gives each one's effective bandwidth, so the table says how
far a step is from the memory floor and whether the layer scan itself costs anything. "Unrolled" takes
each layer's weights as separate buffers (sliced before the jit), which our stacked params are not.

  JAX_PLATFORMS=cuda python benchmarks/investigations/decode_step_floor.py --models qwen2.5-1.5b:bfloat16,qwen2.5-7b:bfloat16
  python benchmarks/investigations/decode_step_floor.py --models tiny:float32      # CPU smoke run
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
from flax import nnx

from _common import best_and_median, command_line, table
from model_shapes import shape_config
from rlver_jax.models import create_model
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams


def best(fn, reps: int) -> float:
  """Best seconds of `reps` calls after a warm-up (compile) call, waiting for each result."""
  jax.block_until_ready(fn())
  return best_and_median(lambda: jax.block_until_ready(fn()), reps)[0]


def our_step(config, dtype, batch: int, reps: int, short: int = 32, long: int = 160) -> tuple[float, int]:
  """(seconds per decode step, param bytes) of our sampler, random weights, no stop ids."""
  model = create_model(config, param_dtype=dtype, dtype=dtype)
  params = nnx.state(model)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  prompts = np.random.default_rng(0).integers(3, config.vocab_size - 1, (batch, 64)).tolist()
  sampler = Sampler(model, max_len=64 + long + 1, stop_ids=[-1], pad_id=0)
  greedy = SamplingParams.make(0.0)

  def run(n):
    cache, logits = sampler.prefill(params, sampler.init_cache(batch), prompts)
    res = sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=n, sampling=greedy)
    assert (res.num_tokens == n).all()
    return res.tokens

  t_short, t_long = best(lambda: run(short), reps), best(lambda: run(long), reps)
  return (t_long - t_short) / (long - short), nbytes


def dot_weights(config, dtype):
  """Random stacked [L, ...] weights of one step's seven projections per layer, the LM head, and the
  query width."""
  c = config
  L, D, F, V = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  shapes = dict(wq=(L, D, q), wk=(L, D, kv), wv=(L, D, kv), wo=(L, q, D), gate=(L, D, F), up=(L, D, F),
                down=(L, F, D))
  keys = iter(jax.random.split(jax.random.key(1), 10))
  w = {n: (jax.random.normal(next(keys), s, jnp.float32) * 0.02).astype(dtype) for n, s in shapes.items()}
  head = (jax.random.normal(next(keys), (V, D), jnp.float32) * 0.02).astype(dtype)
  return w, head, q


def layer(h, p, q):
  """The step's dots; cheap elementwise glue keeps them dependent, as in the model."""
  a = jnp.concatenate([h @ p["wq"], h @ p["wk"], h @ p["wv"]], -1)[:, :q]
  h = h + a @ p["wo"]
  h = h + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
  return h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(h.dtype)


def scanned_dots(q: int):
  """Jitted (x, stacked weights, head) -> next tokens: the step's dots in a layer scan, as the model."""
  @jax.jit
  def step(x, w, head):
    h, _ = jax.lax.scan(lambda h, p: (layer(h, p, q), None), x, w)
    return jnp.argmax(h @ head.T, -1)
  return step


def dots_floor(config, dtype, batch: int, reps: int) -> tuple[float, float, int]:
  """(scan seconds, unrolled seconds, weight bytes) of one step's dots alone."""
  w, head, q = dot_weights(config, dtype)
  x = jnp.ones((batch, config.hidden_size), dtype)

  scanned = scanned_dots(q)
  per_layer = [{n: a[i] for n, a in w.items()} for i in range(config.num_layers)]

  @jax.jit
  def unrolled(x, per_layer, head):
    h = x
    for p in per_layer:
      h = layer(h, p, q)
    return jnp.argmax(h @ head.T, -1)

  nbytes = sum(a.nbytes for a in w.values()) + head.nbytes
  t_scan = best(lambda: scanned(x, w, head), reps)
  del w
  t_unrolled = best(lambda: unrolled(x, per_layer, head), reps)
  return t_scan, t_unrolled, nbytes


def read_bandwidth(gib: float, reps: int) -> float:
  a = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  return a.nbytes / best(lambda: total(a), reps)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--models", default="qwen2.5-1.5b:bfloat16,qwen2.5-7b:bfloat16")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--read-gib", type=float, default=4.0)
  ap.add_argument("--no-dots", dest="dots", action="store_false")
  args = ap.parse_args()
  read = read_bandwidth(args.read_gib, args.reps)
  print(f"read bandwidth {read / 1e9:.0f} GB/s", flush=True)
  rows = []
  for item in args.models.split(","):
    shape, _, dtype_name = item.partition(":")
    config, dtype = shape_config(shape), getattr(jnp, dtype_name or "bfloat16")
    step, params_bytes = our_step(config, dtype, args.batch, args.reps)
    jax.clear_caches()
    t_scan, t_unrolled, dot_bytes = (dots_floor(config, dtype, args.batch, args.reps) if args.dots
                                     else (float("nan"), float("nan"), params_bytes))
    jax.clear_caches()
    gbs = lambda t, n: f"{t * 1e3:.2f} ms ({n / t / 1e9:.0f} GB/s)"
    rows.append([shape, dtype_name, gbs(step, params_bytes), gbs(t_scan, dot_bytes),
                 gbs(t_unrolled, dot_bytes), f"{params_bytes / read * 1e3:.2f} ms",
                 f"{step / min(t_scan, t_unrolled):.2f}"])
    print(" | ".join(rows[-1]), flush=True)
  print(f"\nCommand: `{command_line()}`\n")
  print(f"Machine: {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), jax={jax.__version__}; "
        f"batch {args.batch}, random weights, best of {args.reps}; read bandwidth "
        f"{read / 1e9:.0f} GB/s (jnp.sum of {args.read_gib:g} GiB)\n")
  print(table(["shape", "dtype", "our decode step", "its dots alone, layer scan",
               "its dots alone, unrolled", "weights / read bandwidth", "ours / best dots"], rows))


if __name__ == "__main__":
  main()
