"""Summaries of finished dialogues: Sentient-style score, success / failure rates, breakdowns."""
from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from rlver_jax.env.profiles import intention_key, personality_key
from rlver_jax.env.rollout import Dialogue


def _key_or_raw(fn, profile) -> str:
  try:
    return fn(profile)
  except ValueError:  # custom profiles with their own labels are grouped under those labels
    return "other"


def _rates(finals: np.ndarray) -> dict[str, float]:
  return {"score": float(finals.mean()), "success_rate": float((finals >= 100).mean()),
          "failure_rate": float((finals < 10).mean()), "positive_rate": float((finals > 40).mean()),
          "num_dialogues": int(finals.size)}


def summarize(dialogues: Sequence[Dialogue]) -> dict:
  """score = mean final emotion (0-100); success: ends at 100; failure: ends below 10."""
  finals = np.array([d.final_emotion for d in dialogues], np.float64)
  out = _rates(finals)
  out["mean_turns"] = float(np.mean([len(d.policy_replies) for d in dialogues]))
  for key in ("parse_failures", "reply_failures", "silent_replies"):
    out[key] = int(sum(getattr(d, key) for d in dialogues))
  out["terminations"] = dict(collections.Counter(d.termination for d in dialogues))
  for name, fn in (("by_task", intention_key), ("by_main_cha", personality_key)):
    groups = collections.defaultdict(list)
    for d in dialogues:
      groups[_key_or_raw(fn, d.profile)].append(d.final_emotion)
    out[name] = {k: _rates(np.array(v, np.float64)) for k, v in sorted(groups.items())}
  return out
