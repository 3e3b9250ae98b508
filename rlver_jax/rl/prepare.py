"""From packed rows and the models' log-probs and values to the update batch's advantages, returns and
the step's batch metrics.

Shape legend: N packed rows, T tokens. Inputs and outputs are [N, T] host arrays (float32); the
estimators themselves (`rl.advantages`) run eagerly on the default device, one call each.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rlver_jax.rl import advantages as adv_lib
from rlver_jax.rl import samples
from rlver_jax.rl.losses import explained_variance, kl_penalty
from rlver_jax.rl.pack import PackableDialogue, Packed


class ScoredDialogue(PackableDialogue, Protocol):
  reward: float
  group_id: int


def reference_kl(old_logp: np.ndarray, ref_logp: np.ndarray, mask: np.ndarray) -> float:
  """Mean log-ratio of the policy to the reference over policy tokens (the `kl_ref` metric)."""
  return float(((old_logp - ref_logp) * mask).sum() / max(mask.sum(), 1))


def kl_penalised_rewards(rewards: np.ndarray, old_logp: np.ndarray, ref_logp: np.ndarray,
                         mask: np.ndarray, *, coef: float, kind: str) -> np.ndarray:
  """Per-token rewards less coef x the KL estimate on each policy token (KL in the reward)."""
  kl = np.asarray(kl_penalty(jnp.asarray(old_logp), jnp.asarray(ref_logp), kind))
  return rewards - coef * kl * mask


def grpo_row_advantages(dialogues: Sequence[ScoredDialogue], packed: Packed, *,
                        mean_only: bool, group_stats: str = "dialogue") -> np.ndarray:
  """Each dialogue's group-relative advantage on every policy token of its samples, float32 [N, T].
  The group's mean and std count each dialogue once ("dialogue") or once per row it trains as
  ("turn_rows": think mode with dropped thoughts makes a row per turn)."""
  rewards = np.array([d.reward for d in dialogues], np.float32)
  groups = np.array([d.group_id for d in dialogues], np.int32)
  weights = None if group_stats == "dialogue" else jnp.asarray(stat_rows(dialogues))
  per_dialogue = np.asarray(adv_lib.grpo_advantages(jnp.asarray(rewards), jnp.asarray(groups),
                                                    mean_only=mean_only, weights=weights))
  owner = packed.dialogue  # [N, T]
  per_token = np.where(owner >= 0, per_dialogue[np.maximum(owner, 0)], 0.0)
  return (per_token * packed.loss_mask).astype(np.float32)


def stat_rows(dialogues: Sequence[PackableDialogue]) -> np.ndarray:
  """[D] rows each dialogue trains as (at least 1: an untrained one still counts in its group)."""
  return np.array([max(len(d.samples), 1) for d in dialogues], np.float32)


class Targets(NamedTuple):
  """What an algorithm makes of a packed batch: advantages on every policy token, the critic's returns
  and the tokens it trains on (None without a critic) and the batch metrics it adds."""
  advantages: np.ndarray        # [N, T] float32
  returns: np.ndarray | None    # [N, T]
  metrics: dict[str, float]
  value_mask: np.ndarray | None = None  # [N, T]


# The tokens the critic trains on: the policy's own ("policy_tokens"), or the RLVER reference's
# (verl's critic takes the response's attention mask shifted by one: from the first policy token
# through the position after the sample's last token, simulated-user tokens inside included).
VALUE_MASKS = ("policy_tokens", "reference")


def reference_value_mask(loss_mask: np.ndarray, segment_ids: np.ndarray,
                         room_length: int | None = None) -> np.ndarray:
  """[N, T] 1 from each sample's first policy token through one past its last real token (where its
  row has room for it: the padding after it, `rl.samples`); samples without policy tokens get none.
  `room_length`: a sample at least that long gets no slot past its end (the unpacked row length: a
  packed row longer than it must not add one)."""
  N, T = loss_mask.shape
  run = samples.runs(segment_ids, np)
  t = np.broadcast_to(np.arange(T), (N, T))
  first = np.full(run.size, T)
  np.minimum.at(first, run[loss_mask > 0], t[loss_mask > 0])
  last = np.full(run.size, -2)
  np.maximum.at(last, run[segment_ids > 0], t[segment_ids > 0])
  end = last[run]
  if room_length is not None:
    length = samples.sums_np((segment_ids > 0).astype(np.float32), segment_ids)
    end = np.where(length < room_length, end + 1, end)
  else:
    end = end + 1
  return ((t >= first[run]) & (t <= end)).astype(np.float32)


def critic_targets(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, *, gamma: float,
                   lam: float, whiten: bool, value_mask: np.ndarray | None = None,
                   segment_ids: np.ndarray | None = None) -> Targets:
  """GAE advantages (on policy tokens, whitened over them) and the critic's returns from per-token
  rewards and the critic's values. With `value_mask` the recursion walks its positions instead of
  the policy tokens alone, as the reference's walks every response position: its returns are the
  critic's targets there; without, the critic trains on the policy tokens. `segment_ids`: samples
  packed into rows, each walked on its own."""
  walk = mask if value_mask is None else value_mask
  adv, ret = adv_lib.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(walk), gamma=gamma,
                         lam=lam, segment_ids=None if segment_ids is None else jnp.asarray(segment_ids))
  adv = adv * jnp.asarray(mask > 0)
  if whiten:
    adv = adv_lib.whiten(adv, jnp.asarray(mask))
  metrics = {"value_mean": float((values * walk).sum() / max(walk.sum(), 1)),
             # Over the whole batch (per micro-batch it would be 0 for every row whose returns are
             # constant, as every row's are at gamma = 1).
             "critic/explained_variance": _explained_variance(values, ret, walk)}
  return Targets(np.asarray(adv), np.asarray(ret), metrics, np.asarray(walk, np.float32))


def _explained_variance(values: np.ndarray, returns: jax.Array, mask: np.ndarray) -> float:
  return float(explained_variance(jnp.asarray(values), returns, jnp.asarray(mask)))


def batch_metrics(packed: Packed) -> dict[str, float]:
  """Sizes of the batch: policy tokens, samples, real (unpadded) tokens and the padding's share of
  the batch's tokens (`update_padding`: what rl.pack_update cuts)."""
  real = float((packed.segment_ids > 0).sum())
  return {"policy_tokens": float(packed.loss_mask.sum()), "samples": float(packed.num_real),
          "sample_tokens": real, "update_padding": 1.0 - real / max(packed.tokens.size, 1)}
