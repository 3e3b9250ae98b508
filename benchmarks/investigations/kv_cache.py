"""KV-cache arithmetic for the Qwen2.5 presets: bytes per token and what fits next to the weights.

Pure arithmetic from `rlver_jax.models.presets` (nothing is compiled or allocated). The sampler's cache
is k/v [L, B, K, S, Dh] with the batch axis sharded over data x fsdp, so with the weights FSDP-sharded
over N chips each chip holds W/N of the weights and B/N of the cache rows. Per chip:

  cache budget = (1 - headroom) * HBM - weights / N,   tokens per chip = budget / kv_bytes_per_token

and rows per chip at a context S = floor(tokens per chip / S); the slice holds N times that.

  python benchmarks/investigations/kv_cache.py [--headroom 0.1]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # _common, model_shapes
import _common  # noqa: F401
from _common import command_line, table
from rlver_jax.models.presets import get_preset

GIB = 2**30
CHIPS = {"v5p": 95 * GIB, "v5e": 16 * GIB}
CONTEXTS = (8192, 16384)  # the policy's and the simulator's max_context in configs/base.py


def per_token_table() -> str:
  rows = []
  for name in ("qwen2.5-7b", "qwen2.5-72b"):
    c = get_preset(name)
    bf16, f32 = c.kv_bytes_per_token(jnp.bfloat16), c.kv_bytes_per_token(jnp.float32)
    rows.append([name, c.num_layers, c.num_kv_heads, c.head_dim, f"{bf16:,} ({bf16 / 1024:g} KiB)",
                 f"{f32 / 1024:g} KiB", f"{bf16 * 8192 / GIB:.3f}", f"{c.num_params() / 1e9:.2f}B",
                 f"{c.num_params() * 2 / GIB:.1f}"])
  return table(["model", "layers", "KV heads", "head dim", "KV bytes/token bf16", "fp32",
                "GiB per 8k-token row (bf16)", "params", "bf16 weights GiB"], rows)


def fit_rows(name: str, chips: tuple[int, ...], weight_bytes_per_param: float, headroom: float):
  c = get_preset(name)
  per_tok = c.kv_bytes_per_token(jnp.bfloat16)
  weights = c.num_params() * weight_bytes_per_param
  rows = []
  for chip, hbm in CHIPS.items():
    for n in chips:
      budget = (1 - headroom) * hbm - weights / n
      if budget <= 0:
        rows.append([name, chip, n, f"{weights / n / GIB:.1f}", "does not fit", "-", "-", "-"])
        continue
      tokens = int(budget // per_tok)
      fits = [tokens // s for s in CONTEXTS]
      rows.append([name, chip, n, f"{weights / n / GIB:.1f}", f"{budget / GIB:.1f}", f"{tokens:,}",
                   *[f"{r} ({r * n} on the slice)" for r in fits]])
  return rows


def fit_table(specs, weight_bytes_per_param: float, headroom: float) -> str:
  rows = [r for name, chips in specs for r in fit_rows(name, chips, weight_bytes_per_param, headroom)]
  return table(["model", "chip", "N chips (fsdp)", "weights/chip GiB", "cache budget/chip GiB",
                "cache tokens/chip (batch x context)", "rows/chip at 8k context",
                "rows/chip at 16k context"], rows)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--headroom", type=float, default=0.1)
  args = ap.parse_args()
  h = args.headroom
  print(f"Command: `{command_line()}`\n")
  print("Arithmetic only (presets from rlver_jax.models.presets); KV cache in bf16, "
        f"{h:.0%} of HBM left as headroom; v5p = 95 GiB, v5e = 16 GiB HBM per chip.\n")
  print(per_token_table())
  print("\nbf16 weights (a frozen sampler, e.g. the simulator), FSDP over N chips:\n")
  print(fit_table([("qwen2.5-7b", (1, 4, 8)), ("qwen2.5-72b", (4, 8, 16))], 2, h))
  print("\nThe policy as the trainer holds it during a rollout: fp32 master params (the sampler reads "
        "the live params) + AdamW m and v in fp32 = 12 bytes/param resident:\n")
  print(fit_table([("qwen2.5-7b", (1, 4, 8))], 12, h))


if __name__ == "__main__":
  main()
