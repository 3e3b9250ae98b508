"""The step-time model against a measured step on this CPU.

Measures this CPU's memory read bandwidth (numpy sum, 2 threads, as mem_bandwidth.py) and its fp32
matmul FLOP/s (an XLA:CPU dot at the decode/update widths of SmolLM2-135M), compiles the programs of
a recorded `grpo_think.py:runlocal` step for this CPU (its cache layout, SmolLM2-135M shapes), costs
that step's calls (`calls/*` in its metrics.jsonl) with those peaks, and prints predicted vs measured
seconds. A run to read:

  python -m rlver_jax.main --config=configs/grpo_think.py:runlocal --workdir=/tmp/rl --config.total_steps=2
  python benchmarks/step_time_check.py --metrics=/tmp/rl/metrics.jsonl --step=2
"""
from __future__ import annotations

import argparse
import runpy
import time

import numpy as np

import _common  # noqa: F401  (CPU-only JAX)
from _common import command_line, machine_info
from mem_bandwidth import threaded_sum
from model_shapes import SMOLLM2_135M

import jax
import jax.numpy as jnp

from rlver_jax.aot import forecast, step_calls, step_time
from rlver_jax.aot import target as aot_target
from rlver_jax.aot.report import run_layouts
from rlver_jax.aot.chips import ChipSpec
from rlver_jax.models import presets
from rlver_jax.sampling.kv_cache import default_layout


def read_bandwidth(reps: int = 5) -> float:
  a = np.ones(2**28 // 4, np.float32)  # 256 MiB, well past the caches
  best = min(_seconds(lambda: threaded_sum(a, 2)) for _ in range(reps))
  return a.nbytes / best


def matmul_flops(reps: int = 10) -> float:
  x = jnp.ones((2048, 576), jnp.float32)
  w = jnp.ones((576, 1536), jnp.float32)
  f = jax.jit(lambda x, w: x @ w)
  jax.block_until_ready(f(x, w))
  best = min(_seconds(lambda: jax.block_until_ready(f(x, w))) for _ in range(reps))
  return 2 * 2048 * 576 * 1536 / best


def _seconds(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--metrics", required=True, help="metrics.jsonl of a grpo_think.py:runlocal run")
  ap.add_argument("--step", type=int, default=None, help="the step to check (default: the last)")
  args = ap.parse_args()
  presets.PRESETS["smollm2-135m"] = SMOLLM2_135M
  config = runpy.run_path("../configs/grpo_think.py")["get_config"]("runlocal")
  config.policy.preset = config.simulator.preset = "smollm2-135m"
  chip = ChipSpec("this CPU (measured)", matmul_flops(), read_bandwidth())
  spec = aot_target.from_config(config)
  # The run's layouts on one CPU device (all 1x1x1; 'auto' still decodes from a copy).
  model = step_time.CostModel(spec, run_layouts(spec, jax.devices("cpu")[:1]),
                              layout=default_layout("cpu"))
  calls, measured = step_calls.calls_from_metrics(args.metrics, args.step)
  phases = step_time.estimate(model, calls, chip)
  print(f"Command: `{command_line()}`\n")
  print(machine_info() + "\n")
  print(forecast.format_estimate(phases, chip, measured, header=(
      f"grpo_think.py:runlocal step {int(measured.get('step', 0))} on this CPU, "
      f"{model.compiles} programs compiled")))


if __name__ == "__main__":
  main()
