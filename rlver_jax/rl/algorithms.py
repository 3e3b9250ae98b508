"""The RL algorithm as a value: GRPO (group-relative, no critic) or PPO (a critic, GAE).

The trainer asks the algorithm what differs between them (whether a critic is trained, how
advantages come from a batch, whether dialogues form groups) instead of comparing names.

Shape legend: D dialogues, N packed rows, T tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence, Union

import jax.numpy as jnp
import numpy as np

from rlver_jax.rl.advantages import grpo_advantages
from rlver_jax.rl.pack import Packed
from rlver_jax.rl.prepare import (ScoredDialogue, Targets, critic_targets, grpo_row_advantages,
                                  reference_value_mask, stat_rows)
from rlver_jax.rl.turn_credit import dialogue_turn_advantages, turn_row_advantages


class RLSettings(Protocol):
  """The config.rl fields the algorithms read (the run spec's RLSpec)."""
  group_size: int
  grpo_mean_only: bool
  gamma: float
  lam: float
  whiten_advantages: bool
  reward_mode: str
  kl_in_reward: bool
  kl_coef: float
  turn_credit: str
  dynamic_sampling: bool
  group_stats: str


# What one dialogue counts for in its group's mean and std (GRPO): once, or once per trained row.
GROUP_STATS = ("dialogue", "turn_rows")


@dataclasses.dataclass(frozen=True)
class GRPO:
  """One scalar reward per dialogue, normalised within its group (Dr.GRPO: `mean_only`); with
  `turn_credit` (`rl.turn_credit`, see `rl.turn_credit`) each turn's return-to-go of emotion changes
  instead. `group_stats` (`rl.group_stats`): what a dialogue counts for in the group statistics."""
  mean_only: bool = False
  turn_credit: str = "none"
  group_stats: str = "dialogue"
  name = "grpo"
  has_critic = False
  grouped = True  # advantages compare the dialogues of one profile

  @staticmethod
  def config_problem(rl: RLSettings) -> str | None:
    """Why the settings cannot work with GRPO (None: they can); the message names the key."""
    if rl.reward_mode != "terminal":  # token-level rewards have no place in a per-dialogue scalar
      return (f"config.rl.reward_mode={rl.reward_mode!r} needs algo=ppo: GRPO uses one reward per "
              "dialogue (use 'terminal')")
    if rl.kl_in_reward and rl.kl_coef > 0:
      return ("config.rl.kl_in_reward=True needs algo=ppo: GRPO takes its KL as a loss term (set "
              "kl_in_reward=False)")
    if rl.group_stats != "dialogue" and rl.turn_credit != "none":
      return (f"config.rl.group_stats={rl.group_stats!r} needs rl.turn_credit='none' (turn credit "
              "normalises per turn already)")
    if rl.group_size < 2:
      return (f"config.rl.group_size={rl.group_size}: GRPO needs >= 2 dialogues per profile (a "
              "group of one has zero advantage, so nothing is learned)")
    return None

  def targets(self, dialogues: Sequence[ScoredDialogue], packed: Packed, token_rewards: np.ndarray,
              values: np.ndarray | None) -> Targets:
    """Each dialogue's group-relative advantage on its rows' policy tokens (token rewards and values
    are PPO's; GRPO has one reward per dialogue and no critic)."""
    del token_rewards, values
    if self.turn_credit == "none":
      adv = grpo_row_advantages(dialogues, packed, mean_only=self.mean_only,
                                group_stats=self.group_stats)
      # Rows per dialogue in the group statistics: 1 with "dialogue".
      rows = 1.0 if self.group_stats == "dialogue" else float(stat_rows(dialogues).mean())
      return Targets(adv, None, {"grpo/stat_rows_per_dialogue": rows})
    per_turn = dialogue_turn_advantages(dialogues, mode=self.turn_credit, mean_only=self.mean_only)
    return Targets(turn_row_advantages(dialogues, packed, per_turn), None, {})

  def informative_groups(self, dialogues: Sequence[ScoredDialogue]) -> set[int]:
    """The group ids whose dialogues get some non-zero advantage (the others teach nothing)."""
    if not dialogues:
      return set()
    if self.turn_credit == "none":
      ids = np.array([d.group_id for d in dialogues], np.int32)
      rewards = jnp.asarray([d.reward for d in dialogues], jnp.float32)
      per = np.asarray(grpo_advantages(rewards, jnp.asarray(ids), num_groups=int(ids.max()) + 1,
                                       mean_only=self.mean_only))[:, None]
    else:
      per = dialogue_turn_advantages(dialogues, mode=self.turn_credit, mean_only=self.mean_only)
    return {d.group_id for d, a in zip(dialogues, per) if np.any(a != 0)}

  def warning_groups(self, groups: list[int]) -> list[int]:
    return list(groups)


@dataclasses.dataclass(frozen=True)
class PPO:
  """Token rewards, a learned value baseline, GAE(gamma, lam), optionally whitened; the critic
  trains on `value_mask`'s tokens (`prepare.VALUE_MASKS`)."""
  gamma: float = 1.0
  lam: float = 1.0
  whiten: bool = True
  value_mask: str = "policy_tokens"
  name = "ppo"
  has_critic = True
  grouped = False

  @staticmethod
  def config_problem(rl: RLSettings) -> str | None:
    if rl.turn_credit != "none":
      return (f"config.rl.turn_credit={rl.turn_credit!r} needs algo=grpo: PPO takes per-turn "
              "rewards through rl.reward_mode='per_turn'")
    if rl.dynamic_sampling:
      return ("config.rl.dynamic_sampling=True needs algo=grpo: it drops GRPO groups whose rewards "
              "are all equal")
    return None

  def targets(self, dialogues: Sequence[ScoredDialogue], packed: Packed, token_rewards: np.ndarray,
              values: np.ndarray | None) -> Targets:
    """GAE over the policy tokens from the token rewards and the critic's [N, T] values."""
    del dialogues
    walk = (None if self.value_mask == "policy_tokens"
            else reference_value_mask(packed.loss_mask, packed.segment_ids, packed.room_length))
    return critic_targets(token_rewards, values, packed.loss_mask, gamma=self.gamma, lam=self.lam,
                          whiten=self.whiten, value_mask=walk, segment_ids=packed.segment_ids)

  def warning_groups(self, groups: list[int]) -> list[int]:
    """Every dialogue in one group: PPO's step warnings look at the whole batch."""
    return [0] * len(groups)


Algorithm = Union[GRPO, PPO]
ALGORITHMS = ("grpo", "ppo")


def algorithm_named(name: str, rl: RLSettings, value_mask: str = "policy_tokens") -> Algorithm:
  """The algorithm config.algo names, with its config.rl settings (and PPO's critic.value_mask)."""
  if name == "grpo":
    return GRPO(mean_only=rl.grpo_mean_only, turn_credit=rl.turn_credit, group_stats=rl.group_stats)
  if name == "ppo":
    return PPO(gamma=rl.gamma, lam=rl.lam, whiten=rl.whiten_advantages, value_mask=value_mask)
  raise ValueError(f"unknown algorithm {name!r} (expected one of {ALGORITHMS})")
