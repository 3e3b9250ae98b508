"""Compile programs for a named TPU topology on a CPU machine and report their per-device memory.

  python -m rlver_jax.aot --config=configs/aot_forward.py:qwen2.5-72b --topology=v5p:2x2x2
  python -m rlver_jax.aot --config=configs/aot_forward.py --find_smallest
  python -m rlver_jax.aot --config=configs/grpo_think.py --topology=v5p:2x4x4 [--find_smallest]
  python -m rlver_jax.aot --config=configs/grpo_think.py --topology=v5p:2x4x4 --estimate_time

With a training config (configs/grpo_think.py, ...) it compiles every program of one training step at
the config's real shapes and adds the whole-run plan (`rlver_jax.aot.plan`): per phase, the resident
state plus the largest program's private need, and the run total = the larger phase.

Needs libtpu (`pip install "jax[tpu]==0.12.0.1"`), which can describe and compile for any slice without a
TPU attached. Programs come from `rlver_jax.aot.programs.PROGRAMS`; the config names them in
`config.programs` (a training config: `run_plan.run_programs`; `--programs=a,b` picks some). The
compiling and the report are `rlver_jax.aot.report`; this module is the command line only.
`--estimate_time` prints the step-time model instead (`rlver_jax.aot.step_time`, its flags in
`rlver_jax.aot.step_time_cli`).
"""
from __future__ import annotations

from typing import Sequence

from absl import app, flags
from ml_collections import config_flags

from rlver_jax.aot import plan as run_plan
from rlver_jax.aot import target as aot_target
from rlver_jax.aot.report import evaluate, find_smallest, format_evaluation, format_table
from rlver_jax.aot.step_time_cli import draft_model, run_estimate
from rlver_jax.aot.topology import CANDIDATES, AotError
from rlver_jax.cli.errors import exit_on
from rlver_jax.cli.flags import parse_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file naming the programs to compile.",
                                          lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x2", "TPU slice, e.g. v5e:4x4, v5p:2x2x2, v6e:2x4 "
                                "(with --estimate_time also cpu: this machine's devices).")
_ESTIMATE = flags.DEFINE_bool("estimate_time", False, "Estimate seconds per training step per phase "
                              "from XLA's cost analysis (see rlver_jax.aot.step_time).")
_FIND = flags.DEFINE_bool("find_smallest", False,
                          "Search each chip family for the smallest slice on which every program fits.")
_FAMILIES = flags.DEFINE_list("families", list(CANDIDATES), "Chip families for --find_smallest.")
_ONLY = flags.DEFINE_list("programs", [], "Compile only these of the config's programs (default: all); "
                          "a training config's phase rows need all programs of that phase.")


def _streamed_table():
  """A `log` for find_smallest that prints the table header once, before the first rows."""
  started = []

  def log(rows: str) -> None:
    if not started:
      started.append(True)
      print(format_table([]))
    print(rows, flush=True)
  return log


def _run(config) -> None:
  """Reads the config file's ConfigDict into its typed target (`aot.target`), then runs."""
  target = aot_target.from_config(config)
  if _ESTIMATE.value:
    print(run_estimate(target, _TOPOLOGY.value))
    return
  if not _FIND.value:
    found = draft_model(target) if aot_target.is_run(target) else None  # in the plan, if any
    print(format_evaluation(evaluate(target, _TOPOLOGY.value, only=_ONLY.value,
                                     draft=found and found[0])))
    return
  found = find_smallest(target, _FAMILIES.value, log=_streamed_table(), only=_ONLY.value)
  print()
  for family, f in found.items():
    if f is None:
      print(f"{family}: nothing up to {CANDIDATES[family][-1]} fits")
    else:
      mesh = f.rows[0].mesh
      print(f"{family}: smallest is {f.topology}, mesh data,fsdp,tensor = {'x'.join(map(str, mesh))}"
            + (f"; layouts: {f.layouts}" if f.layouts else ""))
      if f.phases:
        total = run_plan.format_run_total(f.phases, f.topology, "x".join(map(str, mesh)))
        print("  " + total.replace("\n", "\n  "))


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/aot_forward.py")
  try:
    _run(_CONFIG.value)
  except (AotError, ValueError) as e:  # ValueError: a bad config value (e.g. an unknown preset)
    exit_on(e, prefix="aot: error")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
