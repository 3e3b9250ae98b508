"""Summaries of finished dialogues: Sentient-style score, success / failure rates, breakdowns."""
from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from rlver_jax.env.backends import SimulatorBackend, SimulatorBackendError, failure_context
from rlver_jax.env.profiles import intention_key, personality_key
from rlver_jax.env.rollout import Dialogue
from rlver_jax.env.user_state import SIMULATOR_ERROR


def _key_or_other(fn, profile) -> str:
  try:
    return fn(profile)
  except ValueError:  # profiles with labels outside the known sets are grouped together
    return "other"


def _rates(finals: np.ndarray, rewards: np.ndarray) -> dict[str, float]:
  # The rates are on the reward (spec §5): a format-penalised dialogue that ends at 100 earns 0 and
  # is no success. Without a penalty the reward is final / 100, so they match the Sentient ones.
  return {"score": float(finals.mean()), "success_rate": float((rewards >= 1.0).mean()),
          "failure_rate": float((rewards < 0.1).mean()), "positive_rate": float((rewards > 0.4).mean()),
          "num_dialogues": int(finals.size)}


def summarize(dialogues: Sequence[Dialogue]) -> dict:
  """score = mean final emotion (0-100); success: reward >= 1; failure: reward < 0.1; positive:
  reward > 0.4 (reward = final emotion / 100, or 0 under a format penalty)."""
  finals = np.array([d.final_emotion for d in dialogues], np.float64)
  out = _rates(finals, np.array([d.reward for d in dialogues], np.float64))
  out["mean_turns"] = float(np.mean([len(d.policy_replies) for d in dialogues]))
  out["parse_failures"] = int(sum(d.parse_failures for d in dialogues))
  out["reply_failures"] = int(sum(d.reply_failures for d in dialogues))
  out["silent_replies"] = int(sum(d.silent_replies for d in dialogues))
  out["terminations"] = dict(collections.Counter(d.termination for d in dialogues))
  for name, fn in (("by_task", intention_key), ("by_main_cha", personality_key)):
    groups = collections.defaultdict(list)
    for d in dialogues:
      groups[_key_or_other(fn, d.profile)].append(d)
    out[name] = {k: _rates(np.array([d.final_emotion for d in v], np.float64),
                           np.array([d.reward for d in v], np.float64))
                 for k, v in sorted(groups.items())}
  return out


def _cell(text: str | None) -> str:
  return " ".join((text or "").split()).replace("|", "\\|") or "-"


def dialogue_markdown(d: Dialogue) -> str:
  """One dialogue as a Markdown table (TensorBoard's text tab renders it): each user line, the
  policy's reply, the emotion change it earned and the emotion after it."""
  head = (f"**{_cell(d.profile.id)}** ({_cell(d.profile.main_cha)}; wants: {_cell(d.profile.task)}) "
          f"- emotion {d.emotions[0]} -> {d.final_emotion}, ended by {d.termination}")
  rows = ["| turn | user | policy | change | emotion |", "| --- | --- | --- | --- | --- |"]
  for t in d.transcript()["turns"]:
    change = "-" if t["change"] is None else f"{t['change']:+d}"
    rows.append(f"| {len(rows) - 1} | {_cell(t['user'])} | {_cell(t['policy'])} | {change} "
                f"| {t['emotion']} |")
  return "\n\n".join([head, "\n".join(rows)])


def check_no_simulator_errors(dialogues: Sequence[Dialogue], backend: SimulatorBackend,
                              what: str) -> None:
  """An evaluation stops on a failed simulator request (SimulatorBackendError): training goes on
  without that dialogue, but a score averaged over cut-short dialogues would mislead."""
  failed = sum(d.termination == SIMULATOR_ERROR for d in dialogues)
  if failed:
    raise SimulatorBackendError(f"{what}: {failed} of {len(dialogues)} dialogues lost their simulator "
                                f"({failure_context(backend)})")
