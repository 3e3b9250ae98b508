"""One layer of our cached-append attention on CPU vs torch SDPA, at a long prefill's shapes.

`Sampler.append` reads a cache window bucketed to (cached + new) tokens and concatenates the new
tokens after it, so a prefill of T tokens on an empty cache attends over W + T keys with W >= T
(all W masked). This probe times `rlver_jax.models.qwen2.attention` (SmolLM2 heads: 9 query, 3 KV,
head dim 64) at keys = T + W for the window the sampler uses (W = T) and the one a prefill needs
(W = 64, the smallest bucket), next to torch's scaled_dot_product_attention on the same shapes.

  python benchmarks/investigations/attention_probe.py [--rows 2] [--tokens 1024] [--reps 3]

torch runs in this process, so it needs one Python with jax and torch; the project's .venv has none
(jax 0.12 needs Python 3.12, the CPU torch wheel is for 3.11) and exits with a one-line error.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # _common, model_shapes
import _common  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np

from _common import command_line, machine_info, median, table, timed, torch_here
from rlver_jax.models.qwen2 import attention

H, K, DH = 9, 3, 64


def inputs(rows: int, tokens: int, window: int, seed: int = 0):
  """q [B, T, H, Dh], k/v [B, W + T, K, Dh], mask [B, T, W + T] (window empty, causal new part)."""
  r = np.random.default_rng(seed)
  S = window + tokens
  q = r.standard_normal((rows, tokens, H, DH), np.float32)
  k = r.standard_normal((rows, S, K, DH), np.float32)
  v = r.standard_normal((rows, S, K, DH), np.float32)
  causal = np.tril(np.ones((tokens, tokens), bool))
  mask = np.concatenate([np.zeros((tokens, window), bool), causal], axis=1)
  return q, k, v, np.broadcast_to(mask, (rows, tokens, S)).copy()


def time_ours(q, k, v, mask, reps: int) -> float:
  fn = jax.jit(attention)
  args = [jnp.asarray(x) for x in (q, k, v, mask)]
  jax.block_until_ready(fn(*args))
  return median([timed(lambda: jax.block_until_ready(fn(*args)))[1] for _ in range(reps)])


def time_torch(q, k, v, mask, reps: int) -> float:
  import torch
  qt = torch.from_numpy(q).transpose(1, 2)
  kt = torch.from_numpy(k).transpose(1, 2).repeat_interleave(H // K, 1)
  vt = torch.from_numpy(v).transpose(1, 2).repeat_interleave(H // K, 1)
  mt = torch.from_numpy(mask)[:, None]
  sdpa = torch.nn.functional.scaled_dot_product_attention
  with torch.inference_mode():
    sdpa(qt, kt, vt, attn_mask=mt)
    return median([timed(sdpa, qt, kt, vt, attn_mask=mt)[1] for _ in range(reps)])


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, default=2)
  ap.add_argument("--tokens", type=int, default=1024)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--threads", type=int, default=2)
  args = ap.parse_args()
  os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  torch = torch_here()
  torch.set_num_threads(args.threads)
  T = args.tokens
  rows = []
  for window, why in ((T, "what Sampler.append reads (bucket of cached + new)"),
                      (64, "what a prefill needs (smallest bucket)")):
    q, k, v, mask = inputs(args.rows, T, window)
    ours = time_ours(q, k, v, mask, args.reps)
    ref = time_torch(q, k, v, mask, args.reps)
    rows.append([f"{window} + {T}", why, f"{ours:.3f}", f"{ours * 30:.1f}", f"{ref:.3f}", f"{ours / ref:.1f}x"])
  print(f"Command: `{command_line()}`\n")
  print(machine_info() + f", torch={torch.__version__} (in this process)\n")
  print(f"One attention layer, {args.rows} rows x {T} new tokens, SmolLM2 heads (9 q / 3 kv, dim 64), "
        f"fp32, medians of {args.reps}.\n")
  print(table(["keys (window + new)", "window", "ours s/layer", "ours x 30 layers s", "torch SDPA s/layer",
               "ours / torch"], rows))


if __name__ == "__main__":
  main()
