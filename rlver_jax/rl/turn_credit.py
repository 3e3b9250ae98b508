"""Turn-level credit for GRPO (`rl.turn_credit`): each policy turn's advantage from the emotion change
still to come after it, instead of the dialogue's one final reward on every turn.

Shape legend: K turns of one dialogue, N packed rows, T tokens.

Turn k's reward r_k is the emotion's move after reply k, / 100 (the applied, clipped move, as
`UserState.turn_rewards`), so a dialogue's turn rewards sum to its final reward minus start / 100.
When the reward was set apart from the emotion (the think-format penalty scores a dialogue 0), the
difference goes on the last turn: the sum is still reward - start / 100, and since every turn's
return-to-go G_k = r_k + ... + r_{K-1} (undiscounted, like the terminal reward) includes the last turn,
every turn carries the penalty.

Normalisation of G_k inside the dialogue's GRPO group (`rl.advantages.grpo_advantages`, so a set of
equal returns or of one member gets exactly 0, and `mean_only` is Dr.GRPO's):
  "turn_index": over the group's dialogues that reached turn k. This baseline is biased when the
      policy controls dialogue length: which dialogues are still running at turn k (the user has not
      reached 0 or 100 nor left) depends on the policy's own earlier replies, so turn k is compared
      with a set the policy selected, not with the group; and a turn only one dialogue reached gets 0
      whatever it did.
  "all_turns": over every turn of every dialogue of the group. No survivor selection, but early
      turns sum more changes than late ones, so a drift of the emotion favours one end.
"none" (the default) keeps the dialogue's terminal advantage (`prepare.grpo_row_advantages`).

In think mode each turn is its own sample and its tokens get the turn's advantage; with one sequence
per dialogue, the tokens of turn k (after turn k - 1's last token, up to turn k's) get turn k's.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import jax.numpy as jnp
import numpy as np

from rlver_jax.rl.advantages import grpo_advantages
from rlver_jax.rl.pack import Packed

TURN_CREDITS = ("none", "turn_index", "all_turns")


class TurnSample(Protocol):
  tokens: Sequence[int]
  turn_ends: Sequence[int]  # index of the last token of each policy turn in `tokens`


class TurnDialogue(Protocol):
  reward: float
  group_id: int
  emotions: Sequence[int]  # the start emotion, then the emotion after each policy turn
  samples: Sequence[TurnSample]


def turn_rewards(emotions: Sequence[int], reward: float) -> np.ndarray:
  """[K] each turn's emotion move / 100; the last one also takes reward - final emotion / 100."""
  e = np.asarray(emotions, np.float64)
  r = np.diff(e) / 100.0
  if r.size:
    r[-1] += reward - e[-1] / 100.0
  return r


def returns_to_go(rewards: np.ndarray) -> np.ndarray:
  """[K] G_k = r_k + r_{k+1} + ... + r_{K-1}."""
  return np.cumsum(rewards[::-1])[::-1]


def turn_advantages(returns: Sequence[np.ndarray], group_ids: Sequence[int], *, mode: str,
                    mean_only: bool = False) -> list[np.ndarray]:
  """Per dialogue, its turns' returns-to-go normalised within the group (by turn index or over all
  turns, the module docstring's `mode`); float32 arrays of each dialogue's length."""
  if mode not in TURN_CREDITS[1:]:
    raise ValueError(f"unknown turn credit {mode!r}; expected one of {TURN_CREDITS[1:]}")
  keys: dict[tuple[int, int], int] = {}
  segments = []
  for g, ret in zip(group_ids, returns):
    for k in range(len(ret)):
      segments.append(keys.setdefault((int(g), k if mode == "turn_index" else 0), len(keys)))
  if not segments:
    return [np.zeros(0, np.float32) for _ in returns]
  flat = np.concatenate([np.asarray(r, np.float32) for r in returns])
  adv = np.asarray(grpo_advantages(jnp.asarray(flat), jnp.asarray(segments, jnp.int32),
                                   num_groups=len(keys), mean_only=mean_only))
  bounds = np.cumsum([0] + [len(r) for r in returns])
  return [adv[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def dialogue_turn_advantages(dialogues: Sequence[TurnDialogue], *, mode: str,
                             mean_only: bool = False) -> list[np.ndarray]:
  """`turn_advantages` of each dialogue's returns-to-go (`turn_rewards` of its emotions)."""
  returns = [returns_to_go(turn_rewards(d.emotions, d.reward)) for d in dialogues]
  return turn_advantages(returns, [d.group_id for d in dialogues], mode=mode, mean_only=mean_only)


def turn_row_advantages(dialogues: Sequence[TurnDialogue], packed: Packed,
                        per_turn: Sequence[np.ndarray]) -> np.ndarray:
  """[N, T] float32: each policy token of `packed` (the dialogues' samples, as `pack` laid them out)
  gets the advantage of the turn it belongs to."""
  out = np.zeros(packed.loss_mask.shape, np.float32)
  k = 0
  for i, (d, adv) in enumerate(zip(dialogues, per_turn)):
    first = 0  # turns of this dialogue in its earlier samples
    for s in d.samples:
      (row, at), L = packed.at[k], len(s.tokens)
      assert packed.dialogue[row, at] == i, (row, i)  # the same order as pack_into
      ends = np.asarray(s.turn_ends)
      if first + len(ends) > len(adv):
        raise ValueError(f"dialogue {i} has {first + len(ends)} policy turns in its samples but "
                         f"{len(adv)} emotion changes")
      turn = np.minimum(np.searchsorted(ends, np.arange(L), side="left"), len(ends) - 1)
      out[row, at:at + L] = adv[first + turn] * packed.loss_mask[row, at:at + L]
      first += len(ends)
      k += 1
  return out
