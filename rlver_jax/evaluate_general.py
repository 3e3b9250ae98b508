r"""General abilities of a checkpoint (GSM8K, IFEval, MATH500-style, ...) through lm-evaluation-harness.

  python -m rlver_jax.evaluate_general --checkpoint=DIR|--workdir=DIR [--step=N] \
      --tasks=gsm8k,ifeval,... [--include_path=DIR] [--limit=N] --out=FILE [--compare_base]

Runs lm-eval's `simple_evaluate` on this package's model and KV-cached sampler (no conversion to
another stack), with the checkpoint's chat template applied to every prompt (`--apply_chat_template`,
few-shot examples as turns). `--checkpoint` is an HF directory (or `embedded`); `--workdir` a training
run, its policy read from the checkpoint of `--step` (default: the latest). Writes lm-eval's results
JSON to FILE and a one-table summary to FILE with `.md` for `.json`; `--compare_base` (with
`--workdir`) also evaluates the run's base policy (`.base.json` for `.json`) and the table shows before, after
and the change per metric. Tasks in `rlver_jax/evaluation/tasks` (`rlver_tiny_mc`, `rlver_tiny_gen`) ship
with their data; `--include_path` adds a folder of lm-eval task YAMLs (local data files work offline).
"""
from __future__ import annotations

import json
import os

from absl import app, flags

from rlver_jax.parallel import distributed
from rlver_jax.cli.errors import exit_on
from rlver_jax.cli.flags import parse_flags

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "HF checkpoint directory, or 'embedded'.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory (its policy checkpoint).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of --workdir (default: the latest).")
_COMPARE = flags.DEFINE_bool("compare_base", False, "With --workdir: also evaluate the run's base policy.")
_TASKS = flags.DEFINE_list("tasks", None, "lm-eval task names (comma-separated).")
_INCLUDE = flags.DEFINE_string("include_path", None, "A folder of extra lm-eval task YAMLs.")
_LIMIT = flags.DEFINE_integer("limit", None, "At most this many samples per task.")
_OUT = flags.DEFINE_string("out", None, "Results JSON file (the summary table goes beside it as .md).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows per forward pass / decode batch.")
_MAX_LENGTH = flags.DEFINE_integer("max_length", 2048, "Context length in tokens (prompt + generation).")
_MAX_GEN = flags.DEFINE_integer("max_gen_toks", 256, "Generated tokens when a task names none.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Param and compute dtype of --checkpoint (a workdir keeps its run's).")
_CHAT = flags.DEFINE_bool("apply_chat_template", True, "Render prompts with the chat template.")
_MULTITURN = flags.DEFINE_bool("fewshot_as_multiturn", True, "Few-shot examples as chat turns.")
_FEWSHOT = flags.DEFINE_integer("num_fewshot", None, "Few-shot examples (default: each task's own).")
_SYSTEM = flags.DEFINE_string("system_instruction", None, "System message for every prompt.")
_SEED = flags.DEFINE_integer("seed", 1234, "Seed of lm-eval (few-shot order) and of sampling.")
_SAMPLES = flags.DEFINE_bool("log_samples", False, "Keep every sample's prompt and output in the JSON.")
_BOOTSTRAP = flags.DEFINE_integer("bootstrap_iters", 1000, "Bootstrap iterations for stderrs (0: none).")
flags.mark_flags_as_required(["tasks", "out"])
_ALL_FLAGS = (_CHECKPOINT, _WORKDIR, _STEP, _COMPARE, _TASKS, _INCLUDE, _LIMIT, _OUT, _BATCH, _MAX_LENGTH,
              _MAX_GEN, _DTYPE, _CHAT, _MULTITURN, _FEWSHOT, _SYSTEM, _SEED, _SAMPLES, _BOOTSTRAP)


def check_flags() -> None:
  """Bad flags or an unwritable --out fail here, before any model loads."""
  if (_CHECKPOINT.value is None) == (_WORKDIR.value is None):
    raise ValueError("give exactly one of --checkpoint and --workdir")
  if _STEP.value is not None and _WORKDIR.value is None:
    raise ValueError("--step needs --workdir")
  if _COMPARE.value and _WORKDIR.value is None:
    raise ValueError("--compare_base needs --workdir (the base is that run's policy.checkpoint)")
  for name, flag, low in (("batch_size", _BATCH, 1), ("max_length", _MAX_LENGTH, 2),
                          ("max_gen_toks", _MAX_GEN, 1), ("bootstrap_iters", _BOOTSTRAP, 0)):
    if flag.value < low:
      raise ValueError(f"--{name}={flag.value}: must be >= {low}")
  if _LIMIT.value is not None and _LIMIT.value < 1:
    raise ValueError(f"--limit={_LIMIT.value}: must be >= 1")
  if not [t for t in _TASKS.value if t.strip()]:
    raise ValueError("--tasks is empty")
  out = _OUT.value
  parent = os.path.dirname(os.path.abspath(out))
  if not out.endswith(".json") or os.path.isdir(out):
    raise ValueError(f"--out={out}: must be a .json file path")
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
    raise ValueError(f"--out={out}: directory {parent} does not exist or is not writable")
  if _WORKDIR.value is not None and not os.path.isdir(_WORKDIR.value) and not _WORKDIR.value.startswith("gs://"):
    raise FileNotFoundError(f"--workdir={_WORKDIR.value}: no such directory")


def _run_one(general_eval, **source) -> dict:
  tasks = [t.strip() for t in _TASKS.value if t.strip()]
  manager = general_eval.load_tasks(tasks, _INCLUDE.value)  # before the model: fails fast
  lm, what = general_eval.load_lm(**source, dtype=_DTYPE.value, batch_size=_BATCH.value,
                                  max_length=_MAX_LENGTH.value, max_gen_toks=_MAX_GEN.value,
                                  seed=_SEED.value)
  print(f"evaluating {what} on {', '.join(_TASKS.value)}", flush=True)
  results = general_eval.evaluate(
      lm, tasks, task_manager=manager,
      limit=_LIMIT.value, num_fewshot=_FEWSHOT.value, apply_chat_template=_CHAT.value,
      fewshot_as_multiturn=_MULTITURN.value, system_instruction=_SYSTEM.value, seed=_SEED.value,
      log_samples=_SAMPLES.value, bootstrap_iters=_BOOTSTRAP.value)
  results["rlver_jax"] = {"evaluated": what, "flags": {h.name: h.value for h in _ALL_FLAGS}}
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    check_flags()
    distributed.initialize()
    import jax

    from rlver_jax.evaluation import general as general_eval  # after distributed init, as in main.py
    after = _run_one(general_eval, checkpoint=_CHECKPOINT.value, workdir=_WORKDIR.value, step=_STEP.value)
    before = (_run_one(general_eval, workdir=_WORKDIR.value, base_of_workdir=True)
              if _COMPARE.value else None)
  except (ValueError, OSError) as e:  # bad flags, paths, tasks or unreachable data: one line, exit 1
    exit_on(e)
  table = (general_eval.compare_table(before, after) if before is not None
           else general_eval.summary_table(after))
  if jax.process_index() == 0:
    stem = _OUT.value[:-len(".json")]
    with open(_OUT.value, "w") as f:
      json.dump(after, f, indent=2, ensure_ascii=False)
    if before is not None:
      with open(stem + ".base.json", "w") as f:
        json.dump(before, f, indent=2, ensure_ascii=False)
    with open(stem + ".md", "w") as f:
      f.write(table + "\n")
  print(table)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
