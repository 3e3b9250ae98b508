"""config.rl as a spec section: batch layout, advantages, rewards and the loss, each key checked
(`sections` holds the other sections and the shared checks)."""
from __future__ import annotations

import dataclasses

from rlver_jax.env.rollout import REWARD_MODES
from rlver_jax.rl.algorithms import GROUP_STATS
from rlver_jax.rl.losses import AGG_MODES, KL_KINDS, POLICY_LOSSES
from rlver_jax.rl.rollout_correction import IS_CORRECTIONS
from rlver_jax.rl.turn_credit import TURN_CREDITS
from rlver_jax.spec.sections import ConfigError, _is_int, require


@dataclasses.dataclass(frozen=True)
class RLSpec:
  """config.rl: batch layout, advantages, rewards and the loss (configs/base.py says what each is)."""
  profiles_per_step: int = 32
  group_size: int = 4
  # A group's dialogues are copies of one state after the opening (the reference clones them), so
  # they share the user's first line and the group baseline compares replies to the same opening.
  shared_opening: bool = True
  # Their identical prefix (policy: system prompt + opening; simulator: persona, background, opening)
  # is computed once and its KV rows copied; False prefills it for every member (same tokens).
  share_prefix: bool = True
  epochs: int = 1
  # Mini-batches counted in rows, like the reference: -1 = one step's dialogues (profiles_per_step x
  # group_size); in think mode every policy turn is a row, so a step makes about one optimizer update
  # per turn. 0 = a fixed count of rl.mini_batches per step instead.
  mini_batch_rows: int = -1
  mini_batches: int = 1  # used when rl.mini_batch_rows = 0
  # Rows per batch shard (data x fsdp device), x shards = global; at most: a micro-batch holds no
  # more rows than its mini-batch needs (rounded up to the shards), the rest would be padding.
  micro_batch_size: int = 4
  # Several samples a row of the update, each attending to itself only and at its own positions
  # (rl/samples.py): the same losses and gradients as one a row, to float rounding, on ~1/3 fewer
  # rows at the paper's lengths (docs/PERFORMANCE.md).
  pack_update: bool = True
  # Packed rows' length: 0 = the unpacked one (the longest sample's, bucketed: the same micro-batch
  # shapes and memory); more (a multiple of 64) packs tighter at more attention work and memory a row.
  pack_length: int = 0
  grpo_mean_only: bool = False  # Dr.GRPO: no division by the group std
  # GRPO only. Dynamic sampling (DAPO): drop groups whose advantages are all 0 and roll out up to
  # dynamic_sampling_max_rounds more rounds of profiles_per_step groups to refill the batch; slots
  # still empty are filled with dropped groups at zero loss weight (the batch keeps its shape).
  dynamic_sampling: bool = False
  dynamic_sampling_max_rounds: int = 2
  # GRPO only: "none" (the final reward on every turn), or each turn's return-to-go of emotion
  # changes normalised over the group's dialogues at the same turn ("turn_index") or over all of
  # the group's turns ("all_turns"); see rlver_jax/rl/turn_credit.py.
  turn_credit: str = "none"
  gamma: float = 1.0
  lam: float = 1.0
  whiten_advantages: bool = True
  reward_mode: str = "terminal"  # or "per_turn" (emotion deltas on each turn's last token)
  format_penalty: bool = False  # think mode only: a dialogue with a malformed turn scores 0
  # GRPO group mean and std: one value per dialogue ("dialogue"), or one per trained row
  # ("turn_rows": in think mode a row per turn, so long dialogues weigh more).
  group_stats: str = "dialogue"
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float = 0.0  # 0 = off
  value_clip: float = 0.5
  entropy_coef: float = 0.001
  loss_agg: str = "token-mean"  # seq-* modes count samples: with think mode, one per turn
  # chunk-token-mean: a token mean inside each of this many consecutive runs of a mini-batch's
  # rows, then the mean of the runs (the reference: one run per GPU, 32 GPUs).
  loss_agg_chunks: int = 32
  loss_norm_len: int = 0  # seq-mean-token-sum-norm divisor; 0 = policy.max_context
  kl_coef: float = 0.0  # no reference model, as in the paper
  kl_kind: str = "k3"
  kl_in_reward: bool = False
  # Policy-gradient loss: "ppo" (clipped surrogate; clip_high > clip_low is DAPO's clip-higher),
  # "gspo" (sequence ratio, clipped per sequence; pair with loss_agg="seq-mean-token-mean" and the
  # GSPO paper's clip range of 3e-4 / 4e-4), "cispo" (clipped ratio as a weight on logp).
  policy_loss: str = "ppo"
  # Sampler/trainer mismatch correction: "none" | "token_tis" | "seq_tis" (truncated IS, capped at
  # is_cap) | "token_mask" | "seq_mask" | "geo_mask" (drop tokens / samples whose ratio leaves
  # [1/is_cap, is_cap]). mismatch/* metrics are logged every step, the drop shares at is_cap.
  is_correction: str = "none"
  is_cap: float = 2.0
  logits_chunk: int = 1024

  def __post_init__(self):
    for key in ("profiles_per_step", "group_size", "epochs", "mini_batches", "micro_batch_size",
                "logits_chunk"):
      require(f"rl.{key}", getattr(self, key), getattr(self, key) >= 1, ">= 1")
    require("rl.mini_batch_rows", self.mini_batch_rows, self.mini_batch_rows >= -1,
            "-1 (profiles_per_step x group_size), 0 (use rl.mini_batches) or a row count")
    # Counted in rows, the mini-batch count follows the rollout: a count given too would be ignored.
    require("rl.mini_batches", self.mini_batches, self.mini_batches == 1 or self.mini_batch_rows == 0,
            "1 unless rl.mini_batch_rows=0 (mini-batches are counted in rows otherwise)")
    require("rl.loss_agg", self.loss_agg, self.loss_agg in AGG_MODES, f"one of {AGG_MODES}")
    require("rl.loss_agg_chunks", self.loss_agg_chunks,
            _is_int(self.loss_agg_chunks) and self.loss_agg_chunks >= 1,
            "an int >= 1 (chunk-token-mean's runs of rows: the reference's data-parallel width)")
    require("rl.kl_kind", self.kl_kind, self.kl_kind in KL_KINDS, f"one of {KL_KINDS}")
    require("rl.dual_clip", self.dual_clip, self.dual_clip == 0 or self.dual_clip > 1,
            "0 (off) or > 1")
    require("rl.reward_mode", self.reward_mode, self.reward_mode in REWARD_MODES,
            f"one of {REWARD_MODES}")
    require("rl.gamma", self.gamma, 0 <= self.gamma <= 1, "in [0, 1]")
    require("rl.lam", self.lam, 0 <= self.lam <= 1, "in [0, 1]")
    require("rl.clip_low", self.clip_low, 0 < self.clip_low < 1, "in (0, 1)")
    require("rl.clip_high", self.clip_high, self.clip_high > 0, "> 0")
    require("rl.value_clip", self.value_clip, self.value_clip >= 0, ">= 0 (0 = off)")
    require("rl.entropy_coef", self.entropy_coef, self.entropy_coef >= 0, ">= 0")
    require("rl.kl_coef", self.kl_coef, self.kl_coef >= 0, ">= 0")
    require("rl.pack_update", self.pack_update, isinstance(self.pack_update, bool), "True or False")
    require("rl.pack_length", self.pack_length,
            _is_int(self.pack_length) and self.pack_length >= 0 and self.pack_length % 64 == 0,
            "0 (the unpacked row length) or a multiple of 64")
    if self.loss_norm_len < 0:
      raise ConfigError(f"config.rl.loss_norm_len={self.loss_norm_len}: must be >= 0 "
                        "(0 = policy.max_context)")
    self._check_grpo_options()
    _check_policy_loss(self)

  def _check_grpo_options(self) -> None:
    require("rl.dynamic_sampling", self.dynamic_sampling, isinstance(self.dynamic_sampling, bool),
            "True or False")
    rounds = self.dynamic_sampling_max_rounds
    require("rl.dynamic_sampling_max_rounds", rounds, _is_int(rounds) and rounds >= 0,
            "an int >= 0 (extra rollout rounds per step)")
    require("rl.turn_credit", self.turn_credit, self.turn_credit in TURN_CREDITS,
            f"one of {TURN_CREDITS}")
    require("rl.group_stats", self.group_stats, self.group_stats in GROUP_STATS,
            f"one of {GROUP_STATS}")

  @property
  def correction(self) -> tuple[str, float]:
    """(rollout correction, its cap)."""
    return self.is_correction, self.is_cap

  @property
  def rows_per_mini_batch(self) -> int:
    """rl.mini_batch_rows resolved: -1 = one step's dialogues (profiles_per_step x group_size, the
    reference's mini-batch), 0 = off (a fixed rl.mini_batches per step), else that many rows."""
    if self.mini_batch_rows == -1:
      return self.profiles_per_step * self.group_size
    return self.mini_batch_rows

  @property
  def update_pack_length(self) -> int | None:
    """`pack_step`'s pack_length: None (one sample a row) unless rl.pack_update."""
    return self.pack_length if self.pack_update else None

  @property
  def dialogues_per_step(self) -> int:
    return self.profiles_per_step * self.group_size


def _check_policy_loss(rl: RLSpec) -> None:
  """rl.policy_loss, rl.is_correction and rl.is_cap."""
  require("rl.policy_loss", rl.policy_loss, rl.policy_loss in POLICY_LOSSES,
          f"one of {POLICY_LOSSES}")
  require("rl.dual_clip", rl.dual_clip, rl.dual_clip == 0 or rl.policy_loss != "cispo",
          "0 with rl.policy_loss='cispo' (its clipped ratio is a weight, there is no surrogate to cap)")
  require("rl.is_correction", rl.is_correction, rl.is_correction in IS_CORRECTIONS,
          f"one of {IS_CORRECTIONS}")
  require("rl.is_cap", rl.is_cap, rl.is_cap > 1, "> 1 (masks keep ratios in [1/is_cap, is_cap])")
