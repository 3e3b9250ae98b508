"""Simulator decode tokens/s on CPU: bf16 vs int8 weights + int8 KV cache (config simulator.weight_dtype
/ kv_dtype), side by side in one run, on the embedded SmolLM2-135M at batch 8 and 32.

Each setting is built as the trainer builds the simulator (`build.simulator_backend`), prefills the
same chat prompts, warms its decode program up once, then times `--reps` greedy decodes of exactly
`--new` tokens per row (no stop ids). XLA:CPU may not gain from int8: it converts the int8 weights
before its matmuls rather than reading them inside one; the TPU estimate (`python -m rlver_jax.aot
--estimate_time`) is the number that matters for the paper's runs.

  cd benchmarks && python int8_decode.py [--batch 8 32] [--new 64] [--reps 2]
"""
from __future__ import annotations

import argparse

import _common  # noqa: F401  (sets JAX_PLATFORMS=cpu before jax is imported)
import jax
import numpy as np

from _common import command_line, machine_info, median, table, timed
from rlver_jax import build
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.env import simulator_prompts as prompts
from rlver_jax.sampling.strategies import SamplingParams
from rlver_jax.spec import SimulatorSpec

SETTINGS = {"bf16": ("bf16", "bf16"), "int8 weights + KV": ("int8", "int8")}


def prompt_rows(chat, batch: int, length: int) -> list[list[int]]:
  """`batch` simulator system prompts (demo profiles in turn), each cut to `length` tokens."""
  profiles = load_demo_profiles()
  rows = []
  for b in range(batch):
    text = prompts.system_prompt(profiles[b % len(profiles)], "vanilla", "en")
    rows.append(chat.message("system", text)[:length])
  return rows


def tokens_per_s(setting, batch: int, args) -> tuple[float, float]:
  spec = SimulatorSpec(checkpoint="embedded", dtype="bfloat16", max_context=args.prompt + args.new + 8,
                       append_buckets=(args.prompt,), weight_dtype=setting[0], kv_dtype=setting[1])
  backend = build.simulator_backend(spec, None, seed=0)
  sampler, params = backend.sampler, backend.params
  sampler.stop_ids = sampler.stop_ids[:0]  # exactly --new tokens per row
  rows = prompt_rows(backend.chat, batch, args.prompt)
  greedy = SamplingParams.make(temperature=0.0)

  def once():
    cache, logits = sampler.prefill(params, sampler.init_cache(batch), rows)
    jax.block_until_ready(logits)
    res, seconds = timed(sampler.decode, params, cache, logits, rng=jax.random.key(0),
                         max_new_tokens=args.new, sampling=greedy)
    assert int(res.num_tokens.min()) == args.new
    return seconds

  once()  # compiles
  seconds = [once() for _ in range(args.reps)]
  cache_mib = sampler.init_cache(batch).bytes() / 2**20
  return batch * args.new / median(seconds), cache_mib


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--prompt", type=int, default=256)
  ap.add_argument("--reps", type=int, default=2)
  args = ap.parse_args()
  print(machine_info(), "\n", command_line(), flush=True)
  rows = []
  for batch in args.batch:
    got = {name: tokens_per_s(s, batch, args) for name, s in SETTINGS.items()}
    (base, base_mib), (q, q_mib) = got["bf16"], got["int8 weights + KV"]
    rows.append([batch, f"{base:.1f}", f"{q:.1f}", f"{q / base:.2f}x", f"{base_mib:.1f} / {q_mib:.1f}"])
    print(rows[-1], flush=True)
  print(table(["batch", "bf16 tok/s", "int8 tok/s", "int8 / bf16", "KV cache MiB bf16 / int8"], rows))


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
