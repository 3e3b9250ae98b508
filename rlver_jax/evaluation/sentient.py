"""Sentient-style evaluation: profiles -> dialogues (in batches) -> summary, transcripts, plot.

`run(config, workdir)` is the whole evaluation behind `python -m rlver_jax.evaluate`. The parts are
reusable on their own (the trainer's held-out evaluation runs the same dialogues): `run_profiles`
plays every profile once, `eval_summary` scores the dialogues (with a simulator draft, `run` adds its
`simulator/draft_acceptance` and `simulator/tokens_per_verify`; with a policy draft the same under
`policy/`), `write_outputs` writes
WORKDIR/{eval_summary.json, transcripts.jsonl, emotion_trajectories.png, config.json}.
"""
from __future__ import annotations

import io
import json
import time
from typing import Sequence

import jax
import numpy as np
from etils import epath
from flax import nnx

from rlver_jax import build
from rlver_jax.run import provenance
from rlver_jax.evaluation.scoring import check_no_simulator_errors, summarize
from rlver_jax.env.profiles import Profile
from rlver_jax.env.rollout import Dialogue, RolloutConfig, run_dialogues
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.models.tokenizer import ChatTokens
from rlver_jax.parallel.process_zero import on_process_zero
from rlver_jax.run.progress import Progress
from rlver_jax.run.saved_config import check_inputs_on_every_host
from rlver_jax.sampling.drafted import DraftedSampler
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.run.saved_config import config_json
from rlver_jax.spec import EvalSpec, EvaluationSpec, SimulatorSpec

SUMMARY_FILE = "eval_summary.json"
TRANSCRIPTS_FILE = "transcripts.jsonl"
PLOT_FILE = "emotion_trajectories.png"
CONFIG_FILE = "config.json"
SUCCESS_EMOTION = 100  # the paper's success: the dialogue ends at 100
FAILURE_EMOTION = 10   # the paper's failure: the dialogue ends below 10


def select_profiles(profiles: Sequence[Profile], num: int, source: str) -> list[Profile]:
  """The first `num` profiles in file order (0 = all): the same set on every run and host."""
  if num > len(profiles):
    raise build.ConfigError(f"config.eval.num_profiles={num}, but {source} holds only "
                            f"{len(profiles)} profiles")
  return list(profiles[:num] if num else profiles)


def run_profiles(profiles: Sequence[Profile], backend, *, sampler: Sampler, params, chat: ChatTokens,
                 rollout: RolloutConfig, users: EvalSpec, simulator: SimulatorSpec, rng: jax.Array,
                 progress: bool = False) -> list[Dialogue]:
  """Plays every profile once, `users.batch_size` dialogues at a time, with the users' rules of
  config.eval (start emotion, turns, end, change clamp and range, goodbyes) and config.simulator
  (style, retries, guidance);
  Dialogues in profile order.

  Batch i samples with `fold_in(rng, i)`; `group_id` is the profile's index in `profiles`.
  """
  bar = Progress(len(profiles), 0, enabled=progress, desc="eval", unit="dialogues")
  dialogues: list[Dialogue] = []
  for i, start in enumerate(range(0, len(profiles), users.batch_size)):
    batch = list(profiles[start:start + users.batch_size])
    simulated = SimulatedUsers.playing(batch, backend, simulator.user_rules(users))
    dialogues += run_dialogues(batch, list(range(start, start + len(batch))), simulated, sampler=sampler,
                               params=params, chat=chat, cfg=rollout, rng=jax.random.fold_in(rng, i))
    check_no_simulator_errors(dialogues, backend, "evaluation")
    bar.update(len(batch), {"score": f"{np.mean([d.final_emotion for d in dialogues]):.1f}"})
  bar.close()
  return dialogues


def eval_summary(dialogues: Sequence[Dialogue]) -> dict:
  """`summarize` (score, success / failure rates, breakdowns, turns, parse failures) + format."""
  out = summarize(dialogues)
  out["format_violation_rate"] = float(np.mean([not all(d.format_ok) for d in dialogues]))
  return out


def plot_trajectories(dialogues: Sequence[Dialogue], title: str = "") -> bytes:
  """PNG: emotion after each policy reply, one line per dialogue, the mean (carried forward after
  a dialogue ends) in bold, the success / failure thresholds dashed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  fig, ax = plt.subplots(figsize=(7, 4))
  longest = max(len(d.emotions) for d in dialogues)
  padded = np.array([d.emotions + [d.emotions[-1]] * (longest - len(d.emotions)) for d in dialogues],
                    np.float64)
  for d in dialogues:
    ax.plot(range(len(d.emotions)), d.emotions, color="tab:blue", alpha=0.35, linewidth=1)
  ax.plot(range(longest), padded.mean(0), color="black", linewidth=2.5, label="mean")
  ax.axhline(SUCCESS_EMOTION, color="tab:green", linestyle="--", label=f"success (= {SUCCESS_EMOTION})")
  ax.axhline(FAILURE_EMOTION, color="tab:red", linestyle="--", label=f"failure (< {FAILURE_EMOTION})")
  ax.set_xlim(0, max(longest - 1, 1))
  ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  ax.set_ylim(-2, 102)
  ax.set_xlabel("policy replies")
  ax.set_ylabel("emotion")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower left", fontsize=8)
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
  plt.close(fig)
  return buf.getvalue()


def write_outputs(workdir: str, dialogues: Sequence[Dialogue], summary: dict,
                  config: dict) -> dict[str, str]:
  """Writes the four output files (process 0 only; `config`: the config as plain data); returns
  their paths."""
  root = epath.Path(workdir)
  paths = {"summary": root / SUMMARY_FILE, "transcripts": root / TRANSCRIPTS_FILE,
           "plot": root / PLOT_FILE, "config": root / CONFIG_FILE}

  def write() -> None:
    root.mkdir(parents=True, exist_ok=True)
    paths["summary"].write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    paths["transcripts"].write_text(
        "".join(json.dumps(d.transcript(), ensure_ascii=False) + "\n" for d in dialogues))
    title = (f"score {summary['score']:.1f}, success {summary['success_rate']:.0%}, "
             f"failure {summary['failure_rate']:.0%}, {summary['num_dialogues']} dialogues")
    paths["plot"].write_bytes(plot_trajectories(dialogues, title))
    paths["config"].write_text(config_json(config, indent=2) + "\n")
  on_process_zero(f"writing the evaluation's outputs under {root}", write)
  return {k: str(v) for k, v in paths.items()}


def check_workdir(workdir: str) -> None:
  """Refuses a workdir whose config.json is not an evaluation's (a training run's, say)."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.exists():
    return
  try:
    saved = json.loads(path.read_text())
  except ValueError:
    saved = None
  # `kind` says what wrote it; a config.json from before it was written is told by its sections.
  kind = saved.get("kind") if isinstance(saved, dict) else None
  older = (kind is None and isinstance(saved, dict) and "batch_size" in saved.get("eval", {})
           and "rl" not in saved)
  if kind != EvaluationSpec.KIND and not older:
    raise build.ConfigError(f"{path} belongs to another kind of run (a training workdir?); "
                            "evaluate into a separate --workdir")


def check_policy_checkpoint(path: str) -> None:
  """A training workdir is not a policy checkpoint: point at the export step instead."""
  if path != "embedded" and path and epath.Path(path).joinpath("checkpoints").exists():
    raise build.ConfigError(
        f"config.policy.checkpoint: {path} is a training workdir, not an HF checkpoint; export it "
        f"first: python -m rlver_jax.export --workdir={path} --out=HF_DIR")


def run(spec: EvaluationSpec, workdir: str) -> tuple[dict, dict[str, str]]:
  """Evaluates spec.policy on the selected profiles; returns (summary, output paths).

  `spec` is the evaluation's typed spec (`EvaluationSpec.from_config(config)`). Every input is
  checked before any model loads, and nothing is written before the end, so bad input leaves an
  existing workdir as it was.
  """
  if not isinstance(spec, EvaluationSpec):
    raise TypeError(f"evaluation.sentient.run takes an EvaluationSpec "
                    f"(EvaluationSpec.from_config(config)), not {type(spec).__name__}")
  rollout = spec.rollout_config()
  check_workdir(workdir)
  check_policy_checkpoint(spec.policy.checkpoint)
  check_inputs_on_every_host(build.input_paths(spec))
  profiles = select_profiles(build.profiles_from(spec.data.profiles), spec.eval.num_profiles,
                             spec.data.profiles)
  t0 = time.perf_counter()
  parts = build.assemble(spec)  # nothing trains: the policy loads straight into its decode layout
  dialogues = run_profiles(profiles, parts.backend, sampler=parts.sampler,
                           params=nnx.state(parts.policy, nnx.Param), chat=parts.chat,
                           rollout=rollout, users=spec.eval, simulator=spec.simulator,
                           rng=jax.random.key(spec.seed),
                           progress=spec.log.progress_bar and jax.process_index() == 0)
  summary = eval_summary(dialogues)
  # A draft's acceptance over the whole evaluation (training logs the simulator's per step).
  summary.update(getattr(parts.backend, "take_draft_metrics", dict)())
  if isinstance(parts.sampler, DraftedSampler):
    summary.update({f"policy/{k}": v for k, v in parts.sampler.counts.take().items()})
  summary.update(policy_checkpoint=parts.policy_path, eval_seconds=time.perf_counter() - t0,
                 config=json.loads(config_json(spec.source)),
                 provenance={**provenance.describe(spec), "layouts": parts.layouts})
  return summary, write_outputs(workdir, dialogues, summary, spec.source)
