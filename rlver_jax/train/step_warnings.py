"""Warnings about a training step that teaches nothing: a simulator whose answers cannot be read
(the reward is then the start emotion), or groups whose rewards are all equal (zero advantages).

`step_warnings` only looks at plain numbers so any backend's run can share it; the trainer logs
each line it returns.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

UNREADABLE_RATE = 0.5  # warn above this share of a step's emotion steps (or user lines)


def _causes(backend: str, max_new_tokens: int) -> str:
  if backend == "model":
    return (f"likely the simulator model is too small to follow the answer format "
            f"(simulator.checkpoint), or simulator.max_new_tokens={max_new_tokens} cuts its answers "
            f"before the change line")
  if backend == "http":
    return (f"likely the served model (simulator.http_model) does not follow the answer format, or "
            f"simulator.max_new_tokens={max_new_tokens} cuts its answers")
  return "the simulator's answers do not follow the expected format"


def step_warnings(step: int, *, rewards: Sequence[float], groups: Sequence[int],
                  parsed: Sequence[Sequence[bool]], user_lines: int, silent_replies: int,
                  backend: str, max_new_tokens: int, has_signal: bool | None = None) -> list[str]:
  """The warnings for one step (empty when it can teach something).

  rewards / groups: one per dialogue (a PPO run passes one group for all); parsed: per dialogue,
  whether each emotion step's change was read; user_lines / silent_replies: the step's user lines
  and how many of them stood in for a reply that never came. has_signal: whether some advantage is
  non-zero, for algorithms whose signal is not the spread of final rewards (GRPO with turn credit:
  equal final rewards reached along different emotion paths still teach); None judges by rewards.
  """
  out = []
  steps = [ok for d in parsed for ok in d]
  unread = steps.count(False)
  if steps and unread / len(steps) > UNREADABLE_RATE:
    out.append(f"step {step}: the simulator's change line could not be read in {unread} of "
               f"{len(steps)} emotion steps ({unread / len(steps):.0%}); those count as no change, "
               f"so the reward stays near the start emotion; {_causes(backend, max_new_tokens)}")
  if user_lines and silent_replies / user_lines > UNREADABLE_RATE:
    out.append(f"step {step}: {silent_replies} of {user_lines} user lines "
               f"({silent_replies / user_lines:.0%}) had no readable reply and were replaced by "
               f"silence; {_causes(backend, max_new_tokens)}")
  r, g = np.asarray(rewards, np.float64), np.asarray(groups)
  tied = r.size and all(np.ptp(r[g == k]) == 0 for k in np.unique(g))
  no_signal = tied if has_signal is None else not has_signal
  if no_signal:
    where = "every group" if np.unique(g).size > 1 else "the whole batch"
    out.append(f"step {step}: the reward is the same within {where} (no learning signal, all "
               f"advantages are zero): rewards {sorted(set(np.round(r, 4).tolist()))}")
  return out
