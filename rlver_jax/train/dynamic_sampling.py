"""Dynamic sampling (`rl.dynamic_sampling`, after DAPO): a GRPO group whose advantages are all 0 (every
dialogue got the same reward) teaches nothing, so the step drops it and rolls out further rounds
until it has `rl.profiles_per_step` informative groups, or `rl.dynamic_sampling_max_rounds` extra
rounds have run.

Every extra round has the first round's shape (`profiles_per_step` groups of the next profiles of
the data stream, a key folded from the step's), so the rollout compiles nothing new, and a resumed
run draws the same profiles and keys as a straight one. Informative groups beyond the need are not
trained on (`surplus_groups`), as in DAPO's over-sampling. A batch still short after the last round
is filled with dropped groups whose loss mask is zeroed: their rows are padding (no loss weight, no
gradient), so the update batch has the same rows as a full step's.

The step's reward metrics stay those of its first round, the policy's fresh sample as without the
option; `dynamic_sampling/*` metrics describe the rest.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from rlver_jax.env.rollout import Dialogue, RolloutStats


@dataclasses.dataclass
class Round:
  """One rollout round: every dialogue, those without a simulator error, and its counters."""
  dialogues: list[Dialogue]
  trained: list[Dialogue]
  stats: RolloutStats


@dataclasses.dataclass
class StepRollout:
  """What a step's rollout hands to the update and the metrics."""
  dialogues: list[Dialogue]  # every dialogue of every round (transcripts, step warnings)
  first: Round               # the first round (the step's reward and termination metrics)
  trained: list[Dialogue]    # what the update trains on
  stats: RolloutStats
  metrics: dict[str, float]

  @classmethod
  def plain(cls, first: Round) -> StepRollout:
    return cls(first.dialogues, first, first.trained, first.stats, {})


def fill_informative(first: Round, more: Callable[[int], Round],
                     informative: Callable[[list[Dialogue]], set[int]], *, groups: int,
                     max_rounds: int) -> StepRollout:
  """The step's batch of `groups` informative groups from `first` and up to `max_rounds` rounds
  `more(1), more(2), ...`; `informative(dialogues)` names the group ids that carry a signal."""
  rounds = [first]
  kept, dropped = _split(first.trained, informative)
  while len(kept) < groups and len(rounds) <= max_rounds:
    rounds.append(more(len(rounds)))
    good, bad = _split(rounds[-1].trained, informative)
    kept, dropped = kept + good, dropped + bad
  short = max(groups - len(kept), 0)
  batch = kept[:groups] + [[_zero_weight(d) for d in g] for g in dropped[:short]]
  trained = [_with_group(d, g) for g, members in enumerate(batch) for d in members]
  everything = [_with_group(d, r * groups + d.group_id) for r, rnd in enumerate(rounds)
                for d in rnd.dialogues]
  informative_dialogues = [d for g in kept[:groups] for d in g]
  metrics = {
      "dynamic_sampling/dropped_groups": float(len(dropped)),
      "dynamic_sampling/extra_rounds": float(len(rounds) - 1),
      "dynamic_sampling/extra_dialogues": float(sum(len(r.dialogues) for r in rounds[1:])),
      "dynamic_sampling/informative_groups": float(min(len(kept), groups)),
      "dynamic_sampling/surplus_groups": float(max(len(kept) - groups, 0)),
      "dynamic_sampling/padded_groups": float(min(short, len(dropped))),
      "dynamic_sampling/short": float(short > 0),
  }
  if informative_dialogues:
    metrics["dynamic_sampling/trained_reward_mean"] = float(np.mean(
        [d.reward for d in informative_dialogues]))
  return StepRollout(everything, first, trained, _sum_stats([r.stats for r in rounds]),
                     metrics)


def _split(dialogues: list[Dialogue], informative: Callable[[list[Dialogue]], set[int]]
           ) -> tuple[list[list[Dialogue]], list[list[Dialogue]]]:
  """The round's groups (in order of first appearance), informative ones and the others."""
  by_group: dict[int, list[Dialogue]] = {}
  for d in dialogues:
    by_group.setdefault(d.group_id, []).append(d)
  good = informative(dialogues)
  return ([g for k, g in by_group.items() if k in good],
          [g for k, g in by_group.items() if k not in good])


def _zero_weight(d: Dialogue) -> Dialogue:
  """`d` as batch padding: its samples keep their tokens but no token has loss weight."""
  samples = [dataclasses.replace(s, loss_mask=[0] * len(s.loss_mask)) for s in d.samples]
  return dataclasses.replace(d, samples=samples)


def _with_group(d: Dialogue, group_id: int) -> Dialogue:
  return d if d.group_id == group_id else dataclasses.replace(d, group_id=group_id)


def _sum_stats(stats: list[RolloutStats]) -> RolloutStats:
  total = RolloutStats()
  for f in dataclasses.fields(RolloutStats):
    values = [getattr(s, f.name) for s in stats]
    setattr(total, f.name, None if any(v is None for v in values) else sum(values))
  return total
