"""General-ability evaluation of a checkpoint through lm-evaluation-harness (`simple_evaluate`).

`load_lm` builds the `RlverLM` backend from an HF checkpoint directory or a training workdir's
checkpoint; `evaluate` runs lm-eval's tasks on it (the tasks under `rlver_jax/evaluation/tasks` are always
known, others come from lm-eval or `include_path`); `summary_table` / `compare_table` turn results
into one Markdown table each.
"""
from __future__ import annotations

import functools
import json
import math
import os

import jax

from rlver_jax import build
from rlver_jax.run import trained_policy
from rlver_jax.models import load_pretrained
from rlver_jax.models.presets import param_dtype_of
from rlver_jax.models.tokenizer import load_tokenizer
from rlver_jax.parallel.sharding import MeshConfig, make_mesh

LOCAL_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


class TaskError(ValueError):
  """A task that cannot be named or whose data cannot be reached; the message names the task."""


def load_lm(*, checkpoint: str | None = None, workdir: str | None = None, step: int | None = None,
            base_of_workdir: bool = False, dtype: str = "float32", mesh=None, **lm_kwargs):
  """An `RlverLM` over one of: an HF checkpoint dir (or 'embedded') in `dtype`; the policy of a
  workdir's checkpoint `step` (default: latest); or, with `base_of_workdir`, that run's base policy.
  A workdir's policies keep the run's own param/compute dtypes, so base and trained compare fairly.
  Returns (lm, description)."""
  from rlver_jax.evaluation.lm_eval_backend import RlverLM  # lm-eval is imported only when evaluating
  mesh = mesh if mesh is not None else make_mesh(MeshConfig())
  with jax.set_mesh(mesh):
    if checkpoint is not None:
      path = build.resolve_checkpoint(checkpoint, "--checkpoint")
      model, _ = load_pretrained(path, dtype=param_dtype_of(dtype), mesh=mesh,
                                 param_dtype=param_dtype_of(dtype))
      what = path
    elif base_of_workdir:
      model, _, path = build.load_policy(trained_policy.load_run_config(workdir).policy, mesh)
      what = f"{path} (base of {workdir})"
    else:
      model, path, step, _ = trained_policy.load_trained(workdir, step, mesh)
      what = f"{workdir} step {step}"
  build.check_context(model.config.max_position_embeddings, lm_kwargs.get("max_length", 2048),
                      "--max_length")
  lm = RlverLM(model, load_tokenizer(path), mesh=mesh, checkpoint_dir=path, name=what, **lm_kwargs)
  return lm, what


@functools.lru_cache(maxsize=None)
def _manager(paths: tuple[str, ...]):
  """One TaskManager per set of task folders: indexing lm-eval's ~10k task YAMLs takes seconds."""
  from lm_eval.tasks import TaskManager

  class CheckedTasks(TaskManager):
    """Names the task that is unknown or whose data cannot be loaded, in one line; hands out the
    tasks `load_tasks` built once more (to `simple_evaluate`)."""

    prefetched: dict = {}

    def load(self, task_list):
      key = json.dumps(task_list, default=str)
      if key in self.prefetched:
        return self.prefetched.pop(key)
      return super().load(task_list)

    def _load_spec(self, spec):
      if isinstance(spec, str) and self._entry(spec) is None and not os.path.isfile(spec):
        raise TaskError(f"--tasks: unknown task {spec!r} (not one of lm-eval's tasks, "
                        f"rlver_jax/evaluation/tasks or --include_path)")
      try:
        return super()._load_spec(spec)
      except Exception as e:  # noqa: BLE001  every loader (hub, local files, scripts) fails its own way
        detail = (str(e).strip().splitlines() or [""])[0][:300]
        raise TaskError(f"--tasks: the data of task {spec!r} cannot be reached "
                        f"({type(e).__name__}: {detail})") from e

  return CheckedTasks(include_path=list(paths))


def load_tasks(tasks: list[str], include_path: str | None = None):
  """A TaskManager over lm-eval's tasks, rlver_jax/evaluation/tasks and `include_path`, with `tasks`
  already built (data loaded), so an unknown task or unreachable data fails before any model loads.
  Its next `load(tasks)` (the one `simple_evaluate` makes) returns them."""
  paths = [LOCAL_TASKS] + ([os.path.abspath(include_path)] if include_path else [])
  for p in paths:
    if not os.path.isdir(p):
      raise TaskError(f"--include_path={p}: no such directory")
  manager = _manager(tuple(paths))
  tasks = list(tasks)
  manager.prefetched = {}
  manager.prefetched = {json.dumps(tasks): manager.load(tasks)}
  return manager


def evaluate(lm, tasks: list[str], *, task_manager=None, include_path: str | None = None,
             limit: int | None = None, num_fewshot: int | None = None,
             apply_chat_template: bool | None = True, fewshot_as_multiturn: bool = True,
             system_instruction: str | None = None, seed: int = 1234, log_samples: bool = False,
             bootstrap_iters: int = 1000) -> dict:
  """lm-eval's results dict (JSON-ready) for `tasks` on `lm`. `task_manager`: from `load_tasks`
  (else built here); `apply_chat_template=None`: when the tokenizer has a chat template."""
  from lm_eval import simple_evaluate
  from lm_eval.utils import handle_non_serializable
  has_template = bool(getattr(lm.tokenizer, "chat_template", None))
  if apply_chat_template is None:
    apply_chat_template = has_template
  if apply_chat_template and not has_template:
    raise ValueError("--apply_chat_template: the checkpoint's tokenizer has no chat template; "
                     "pass --noapply_chat_template")
  tasks = list(tasks)
  results = simple_evaluate(
      model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
      task_manager=task_manager or load_tasks(tasks, include_path),
      apply_chat_template=apply_chat_template,
      fewshot_as_multiturn=fewshot_as_multiturn and apply_chat_template,
      system_instruction=system_instruction, log_samples=log_samples,
      bootstrap_iters=bootstrap_iters, random_seed=seed, numpy_random_seed=seed,
      torch_random_seed=seed, fewshot_random_seed=seed)
  results["config"]["model"] = getattr(lm, "name", type(lm).__name__)
  return json.loads(json.dumps(results, default=handle_non_serializable))


def metric_rows(results: dict) -> list[dict]:
  """One row per (task, metric, filter): value, stderr (None when lm-eval gives none), samples."""
  rows = []
  for task, values in results.get("results", {}).items():
    n = results.get("n-samples", {}).get(task, {}).get("effective")
    for key, value in values.items():
      if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
        continue
      metric, filt = key.split(",", 1)
      stderr = values.get(f"{metric}_stderr,{filt}")
      rows.append({"task": task, "metric": metric, "filter": filt, "value": float(value),
                   "stderr": float(stderr) if isinstance(stderr, (int, float)) else None, "n": n})
  return rows


def _fmt(x: float | None) -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def summary_table(results: dict) -> str:
  lines = ["| task | metric | filter | value | stderr | samples |", "| --- | --- | --- | --- | --- | --- |"]
  for r in metric_rows(results):
    lines.append(f"| {r['task']} | {r['metric']} | {r['filter']} | {_fmt(r['value'])} | "
                 f"{_fmt(r['stderr'])} | {r['n'] if r['n'] is not None else '-'} |")
  return "\n".join(lines)


def compare_rows(before: dict, after: dict) -> list[dict]:
  """Rows of both results, matched by (task, metric, filter); change = after - before."""
  old = {(r["task"], r["metric"], r["filter"]): r for r in metric_rows(before)}
  rows = []
  for r in metric_rows(after):
    b = old.get((r["task"], r["metric"], r["filter"]))
    rows.append({"task": r["task"], "metric": r["metric"], "filter": r["filter"],
                 "before": b["value"] if b else None, "after": r["value"],
                 "change": r["value"] - b["value"] if b else None, "n": r["n"]})
  return rows


def compare_table(before: dict, after: dict) -> str:
  lines = ["| task | metric | filter | before | after | change | samples |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in compare_rows(before, after):
    change = "-" if r["change"] is None else f"{r['change']:+.4f}"
    lines.append(f"| {r['task']} | {r['metric']} | {r['filter']} | {_fmt(r['before'])} | "
                 f"{_fmt(r['after'])} | {change} | {r['n'] if r['n'] is not None else '-'} |")
  return "\n".join(lines)
