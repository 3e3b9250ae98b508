"""Advantage estimators: GRPO group baselines, GAE over policy tokens, whitening.

Shape legend: N responses (GRPO rows), B sequences, T tokens, G groups.

A multi-turn dialogue is one sequence of T tokens in which only the policy's own tokens are
trained on (`mask` == 1); user-simulator, system and padding tokens have `mask` == 0. GAE here
walks the policy tokens only, so the discount counts policy tokens, not simulator tokens.

All arithmetic is in fp32: bf16 keeps ~3 significant digits, too few for return recursions and
group statistics over rewards that differ in the second decimal.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from rlver_jax.rl import samples

_F32 = jnp.float32


def grpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    *,
    valid: jax.Array | None = None,
    num_groups: int | None = None,
    mean_only: bool = False,
    weights: jax.Array | None = None,
    eps: float = 1e-6,
) -> jax.Array:
  """Group-relative advantages: (r - group mean) / (group std + eps).

  Args:
    rewards: [N] one scalar reward per response.
    group_ids: [N] int, the prompt group of each response; must lie in [0, num_groups).
    valid: optional [N] mask; rows with valid == 0 (batch padding) are left out of every group
      statistic and get advantage 0.
    num_groups: static number of group ids G; defaults to N, which fits any labelling of N
      responses with ids 0..N-1. Pass it (as a Python int) when jitting with fewer groups.
    mean_only: Dr.GRPO: subtract the group mean but do not divide by the std (the std division
      up-weights near-unanimous groups and biases toward easy/hard prompts).
    weights: optional [N] counts: response i stands for weights[i] identical rows in the group's
      mean and (unbiased) std, so a dialogue trained as one row per turn counts once per turn, as
      in the reference's statistics over per-turn rows. None: 1 each.
    eps: added to the std, not the variance, as in the GRPO paper.

  Returns:
    [N] advantages. Groups with one valid member, and groups whose valid rewards are all equal,
    get exactly 0: neither carries a learning signal relative to its baseline.
  """
  r = rewards.astype(_F32)
  n = r.shape[0]
  g = n if num_groups is None else num_groups
  ids = group_ids.astype(jnp.int32)
  ok = jnp.ones((n,), bool) if valid is None else valid.astype(bool)
  w = ok.astype(_F32)
  k = w if weights is None else w * weights.astype(_F32)

  count = jax.ops.segment_sum(k, ids, num_segments=g)
  mean = jax.ops.segment_sum(k * r, ids, num_segments=g) / jnp.maximum(count, 1.0)
  centred = (r - mean[ids]) * w
  var = jax.ops.segment_sum(k * centred**2, ids, num_segments=g) / jnp.maximum(count - 1.0, 1.0)
  # Equal rewards must give exactly 0; (r - mean) can be ~1e-8 from rounding of the mean, and with
  # a ~1e-8 std that rounding noise would become an O(1) advantage. Compare max and min instead.
  hi = jax.ops.segment_max(jnp.where(ok, r, -jnp.inf), ids, num_segments=g)
  lo = jax.ops.segment_min(jnp.where(ok, r, jnp.inf), ids, num_segments=g)

  adv = centred if mean_only else centred / (jnp.sqrt(var)[ids] + eps)
  informative = ok & (count[ids] > 1.0) & (hi[ids] > lo[ids])
  return jnp.where(informative, adv, 0.0)


def gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    *,
    gamma: float,
    lam: float,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation over policy tokens only, each sample on its own.

  The recursion skips every position with mask == 0: the bootstrap value of a policy token is the
  value of the *next policy token* (possibly in a later turn, after simulator tokens), and after the
  last policy token it is 0 (the dialogue is over). Rewards are read at policy positions only (the
  last policy token for a terminal reward, or the last token of each policy turn for per-turn
  rewards); a reward placed on a masked position is ignored.

  Args:
    rewards: [B, T] per-token rewards.
    values: [B, T] critic values V(s_t).
    mask: [B, T] 1 on policy tokens, 0 elsewhere.
    gamma: discount per policy token.
    lam: GAE lambda.
    segment_ids: [B, T] samples packed in a row (`rl.samples`): the recursion starts afresh at
      each sample's end, as it does at a row's. None: a row is one sample.

  Returns:
    (advantages [B, T], returns [B, T]) with returns = advantages + values; both 0 where mask == 0.
  """
  r = rewards.astype(_F32)
  v = values.astype(_F32)
  m = mask > 0

  def step(carry, xs):
    r_t, v_t, m_t, fresh = xs  # fresh: the next position starts another sample
    next_value, next_adv = (jnp.where(fresh, 0.0, c) for c in carry)
    delta = r_t + gamma * next_value - v_t
    adv_t = delta + gamma * lam * next_adv
    # Non-policy positions pass the carry through untouched, which is what makes the jump.
    carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv_t, next_adv))
    return carry, jnp.where(m_t, adv_t, 0.0)

  zeros = jnp.zeros(r.shape[:1], _F32)
  fresh = jnp.zeros(m.shape, bool)
  if segment_ids is not None:
    fresh = jnp.pad(samples.starts(segment_ids)[:, 1:], ((0, 0), (0, 1)))
  _, adv_tb = lax.scan(step, (zeros, zeros), (r.T, v.T, m.T, fresh.T), reverse=True)
  adv = adv_tb.T
  returns = jnp.where(m, adv + v, 0.0)
  return adv, returns


def whiten(
    x: jax.Array,
    mask: jax.Array,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> jax.Array:
  """Normalises x to zero mean and unit variance over masked positions.

  Uses the unbiased (ddof=1) variance, so a batch of two tokens is not over-scaled; with a single
  masked token the variance falls back to ddof=0 (i.e. 0) rather than dividing by zero.

  Args:
    x: any shape.
    mask: same shape as x; statistics use positions with mask != 0 only.
    shift_mean: if False, the mean is added back after scaling (only the scale changes).
    eps: added to the variance.

  Returns:
    Whitened x, 0 at masked positions.
  """
  xf = x.astype(_F32)
  w = (mask > 0).astype(_F32)
  n = w.sum()
  mean = (xf * w).sum() / jnp.maximum(n, 1.0)
  var = (((xf - mean) * w) ** 2).sum() / jnp.maximum(n - 1.0, 1.0)
  out = (xf - mean) * lax.rsqrt(var + eps)
  if not shift_mean:
    out = out + mean
  return out * w


def broadcast_sequence_advantage(adv: jax.Array, mask: jax.Array) -> jax.Array:
  """[B] per-sequence advantages -> [B, T]: the scalar on every policy token, 0 elsewhere."""
  return adv.astype(_F32)[:, None] * (mask > 0).astype(_F32)
