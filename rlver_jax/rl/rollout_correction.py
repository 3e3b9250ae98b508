"""Rollout correction: the sampler/trainer mismatch, the importance weights or masks that correct the
policy loss for it, and the mismatch metrics logged every step.

Shape legend: B rows, T tokens. A sequence is one sample (in think mode with dropped thoughts, one
policy turn): a row, or with `segment_ids` each sample packed into a row (`rl.samples`).

The policy is sampled on its own cache path (often bf16, possibly with a reshaped distribution) and
trained from fp32 master weights, so the trainer's log-prob of a sampled token at the rollout's
weights (`old_logp`) differs from the sampler's (`rollout_logp`). Per token the mismatch log-ratio is
delta = old_logp - rollout_logp, and exp(delta) = pi_trainer / pi_sampler is the importance ratio
that turns an expectation over the sampler's tokens into one over the trainer's. This is not the PPO
ratio (current / old trainer log-probs); the two multiply.

Corrections (`rl.is_correction`, cap c = `rl.is_cap`), each a [B, T] weight without gradient that
scales every token's policy loss:
  token_tis:  min(exp(delta_t), c) per token (truncated IS).
  seq_tis:    min(exp(sum_t delta_t), c), the sample's product of token ratios, on all its tokens.
  token_mask: 1 where exp(delta_t) is in [1/c, c], else 0 (the token is dropped).
  seq_mask:   1 on a whole sample whose product of ratios is in [1/c, c], else 0.
  geo_mask:   the same with the geometric mean of its token ratios, exp(mean_t delta_t).
Masks keep weight 1 on what they keep (rejection, no reweighting). A dropped token stays in the
aggregation's denominator: the weights are computed before the update over the whole mini-batch
(`rl.losses.token_weights`), so micro-batch accumulation stays exact, and a dropped token counts as
an importance weight of 0.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from rlver_jax.rl import samples

_F32 = jnp.float32
IS_CORRECTIONS = ("none", "token_tis", "seq_tis", "token_mask", "seq_mask", "geo_mask")


def _sample_sum_and_count(delta: jax.Array, w: jax.Array, segment_ids: jax.Array | None
                          ) -> tuple[jax.Array, jax.Array]:
  """[B, T] sums of delta over each token's sample's policy tokens, and their counts."""
  return samples.sums(delta * w, segment_ids), samples.sums(w, segment_ids)


def _inside(log_value: jax.Array, cap: float) -> jax.Array:
  """exp(log_value) in [1/cap, cap], as float 0/1."""
  bound = math.log(cap)
  return ((log_value >= -bound) & (log_value <= bound)).astype(_F32)


def correction_weights(old_logp: jax.Array, rollout_logp: jax.Array | None, mask: jax.Array,
                       kind: str, cap: float | None, *, segment_ids: jax.Array | None = None
                       ) -> jax.Array | None:
  """The [B, T] weights of correction `kind` (None for "none"), without gradient; the seq_* kinds
  per sample of `segment_ids` (None: per row)."""
  if kind not in IS_CORRECTIONS:
    raise ValueError(f"unknown rollout correction {kind!r}; valid: {', '.join(IS_CORRECTIONS)}")
  if kind == "none":
    return None
  if rollout_logp is None or cap is None:
    raise ValueError(f"rollout correction {kind!r} needs the sampler's log-probs and a cap")
  old = jax.lax.stop_gradient(old_logp.astype(_F32))
  rollout = rollout_logp.astype(_F32)
  if kind == "token_tis":  # the ops of the former rl.tis_cap, so its results are kept bitwise
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old - rollout), cap))
  w = (mask > 0).astype(_F32)
  delta = old - rollout
  if kind == "token_mask":
    return jax.lax.stop_gradient(_inside(delta, cap))
  seq_sum, count = _sample_sum_and_count(delta, w, segment_ids)
  if kind == "seq_tis":  # capped in log space: a long sample's product can overflow fp32
    row = jnp.exp(jnp.minimum(seq_sum, math.log(cap)))
  elif kind == "seq_mask":
    row = _inside(seq_sum, cap)
  else:
    row = _inside(seq_sum / jnp.maximum(count, 1.0), cap)
  return jax.lax.stop_gradient(jnp.broadcast_to(row, delta.shape))


def mismatch_metrics(old_logp: np.ndarray, rollout_logp: np.ndarray, mask: np.ndarray, *,
                     cap: float, segment_ids: np.ndarray | None = None) -> dict[str, float]:
  """The sampler/trainer mismatch over the policy tokens of a batch ([..., T] host arrays).

  mismatch/kl: KL(sampler || trainer) by the k3 estimator on the sampled tokens,
    mean(exp(delta) - 1 - delta): unbiased since the tokens come from the sampler, and >= 0 per
    token. mismatch/kl_k1: the plain estimator mean(-delta) (unbiased, noisier, can be < 0). Both in
    float64 on the host: in fp32, exp(delta) - 1 - delta of a delta ~1e-4 cancels to 0.
  mismatch/log_ratio_abs_max, _abs_mean: of |delta| per token; seq_log_ratio_abs_max: of |sum delta|
    per sample (of `segment_ids` where rows are packed).
  mismatch/{token,seq,geo}_mask_drop_frac: the share of policy tokens that token_mask, seq_mask or
    geo_mask at cap `cap` would drop (whatever the run's correction; decided in fp32 as in the loss).
  """
  T = mask.shape[-1]
  seg = None if segment_ids is None else np.asarray(segment_ids).reshape(-1, T)
  old = np.asarray(old_logp, np.float64).reshape(-1, T)
  rollout = np.asarray(rollout_logp, np.float64).reshape(-1, T)
  w = (np.asarray(mask).reshape(-1, T) > 0).astype(np.float64)
  n = max(w.sum(), 1.0)
  delta = (old - rollout) * w
  mean = lambda x: float((x * w).sum() / n)
  out = {"mismatch/kl": mean(np.expm1(delta) - delta), "mismatch/kl_k1": mean(-delta),
         "mismatch/log_ratio_abs_max": float(np.abs(delta).max(initial=0.0)),
         "mismatch/log_ratio_abs_mean": mean(np.abs(delta)),
         "mismatch/seq_log_ratio_abs_max": float(np.abs(samples.sums_np(delta, seg)).max(initial=0.0))}
  for kind in ("token_mask", "seq_mask", "geo_mask"):
    kept = correction_weights(jnp.asarray(old_logp, _F32).reshape(-1, T),
                              jnp.asarray(rollout_logp, _F32).reshape(-1, T), jnp.asarray(w), kind, cap,
                              segment_ids=None if seg is None else jnp.asarray(seg))
    out[f"mismatch/{kind}_drop_frac"] = mean(1.0 - np.asarray(kept, np.float64))
  return out
