"""The few lines a training run ends with: did the reward move, where the outputs are, and a short
piece of a late dialogue that shows what the policy now says."""
from __future__ import annotations

import json

from etils import epath

WINDOW = 3  # steps averaged at the start and at the end
_EXCERPT_CHARS = 160


def reward_start_end(rewards: list[float]) -> tuple[float, float, int] | None:
  """(mean of the first n, mean of the last n, n) with n = WINDOW, fewer when the run is shorter
  than two windows (the two never overlap); None below two steps."""
  n = min(WINDOW, len(rewards) // 2)
  if n == 0:
    return None
  return sum(rewards[:n]) / n, sum(rewards[-n:]) / n, n


def _short(text: str | None) -> str:
  text = " ".join((text or "").split())
  return text if len(text) <= _EXCERPT_CHARS else text[:_EXCERPT_CHARS - 3] + "..."


def late_excerpt(transcripts_dir: str) -> list[str]:
  """The best-rewarded dialogue of the last transcript file, its last two exchanges."""
  files = sorted(epath.Path(transcripts_dir).glob("step_*.jsonl")) if epath.Path(
      transcripts_dir).exists() else []
  if not files:
    return []
  dialogues = [json.loads(l) for l in files[-1].read_text().splitlines() if l.strip()]
  if not dialogues:
    return []
  d = max(dialogues, key=lambda t: t["reward"])
  turns = [t for t in d["turns"] if t["policy"] is not None][-2:]
  step = files[-1].stem[len("step_"):].lstrip("0") or "0"
  out = [f"a late dialogue (step {step}, profile {d['profile_id']}, final emotion "
         f"{d['final_emotion']:g}, reward {d['reward']:.2f}):"]
  for t in turns:
    out.append(f"  user:   {_short(t['user'])}")
    out.append(f"  policy: {_short(t['policy'])}   [change {t['change']:+g} -> emotion {t['emotion']:g}]")
  return out


def _exists(path: str | None, pattern: str | None = None) -> bool:
  """Whether `path` exists (and holds a file matching `pattern`, when given)."""
  if not path or not epath.Path(path).exists():
    return False
  return pattern is None or any(epath.Path(path).glob(pattern))


def summary_lines(history: list[dict], paths: dict[str, str | None]) -> list[str]:
  """The end-of-run summary from the metrics rows and the output paths of `train.run`; an output
  the run did not write (no steps, transcripts or TensorBoard off) is not listed."""
  rewards = [r["reward_mean"] for r in history if r.get("reward_mean") is not None]
  out = []
  moved = reward_start_end(rewards)
  if moved is not None:
    first, last, n = moved
    out.append(f"reward (final emotion / 100): mean of the first {n} steps {first:.3f}, of the last "
               f"{n} steps {last:.3f} ({last - first:+.3f}) over {len(rewards)} steps")
  elif rewards:
    out.append(f"reward (final emotion / 100): {rewards[-1]:.3f} after {len(rewards)} step(s)")
  if _exists(paths.get("reward_plot")):
    out.append(f"reward plot:  {paths['reward_plot']}")
  if _exists(paths.get("transcripts"), "step_*.jsonl"):
    out.append(f"transcripts:  {paths['transcripts']}/step_*.jsonl (one dialogue a line)")
  if _exists(paths.get("tensorboard"), "events.out.tfevents.*"):
    out.append(f"TensorBoard:  tensorboard --logdir {paths['tensorboard']}  (scalars, held-out "
               f"dialogues as text, emotion trajectories)")
  if _exists(paths.get("metrics")):
    out.append(f"metrics:      {paths['metrics']}")
  if _exists(paths.get("checkpoints"), "*"):
    out.append(f"checkpoints:  {paths['checkpoints']}")
  return out + (late_excerpt(paths["transcripts"]) if paths.get("transcripts") else [])


def print_run_end(workdir: str, spec, paths: dict) -> int:
  """Prints how the run ended and where its outputs are (process 0), and the stop line of a run a
  signal stopped; returns the exit status (`run.outcomes`)."""
  import sys

  import jax

  from rlver_jax.run.metrics import MetricsWriter
  from rlver_jax.run.outcomes import FINISHED, exit_status, signal_of, stopped_line
  paths = dict(paths)
  step, outcome = paths.pop("step"), paths.pop("outcome")
  history = MetricsWriter(workdir, tensorboard=False).history()  # on every host: its set-up is collective
  if jax.process_index() == 0:  # one summary per run, not one per host
    print(f"\nrun {outcome} at step {step}; outputs under {workdir}:")
    for line in summary_lines(history, paths):
      print(f"  {line}")
  if outcome == FINISHED:
    return 0
  signum = signal_of(outcome)  # a status of its own: a retry loop re-runs the command on 75
  if jax.process_index() == 0:
    print(stopped_line(int(step), spec.total_steps, signum), file=sys.stderr, flush=True)
  return exit_status(signum)
