"""Rollout correction and mismatch metrics against hand-computed values.

One batch of three samples (rows) with cap c = 2.5, so kept ratios lie in [0.4, 2.5]. Sampler/trainer
ratios exp(old_logp - rollout_logp) on the policy tokens:
  row 0: 2.0, 0.25, 1.5   product 0.75, geometric mean 0.909  (0.25 leaves [0.4, 2.5])
  row 1: 3.0, 1.2         product 3.6,  geometric mean 1.897  (3.0 leaves; the product leaves)
  row 2: 3.0, 3.0         product 9.0,  geometric mean 3.0    (everything leaves)
Token 0 of every row (prompt) and the padding have ratios 100 and 50 that must not count.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlver_jax.rl.losses import aggregate, policy_loss
from rlver_jax.rl.rollout_correction import correction_weights, mismatch_metrics

CAP = 2.5
RATIOS = np.array([[100.0, 2.0, 0.25, 1.5], [100.0, 3.0, 1.2, 50.0], [100.0, 3.0, 3.0, 50.0]])
MASK = np.array([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 0]], np.float32)
OLD = np.full(RATIOS.shape, -1.0, np.float32)
ROLLOUT = (OLD - np.log(RATIOS)).astype(np.float32)

# The expected weight of every policy token, row by row (hand-worked from the table above).
EXPECTED = {
    "token_tis": [[2.0, 0.25, 1.5], [2.5, 1.2], [2.5, 2.5]],
    "seq_tis": [[0.75] * 3, [2.5] * 2, [2.5] * 2],
    "token_mask": [[1, 0, 1], [0, 1], [0, 0]],
    "seq_mask": [[1, 1, 1], [0, 0], [0, 0]],
    "geo_mask": [[1, 1, 1], [1, 1], [0, 0]],
}


def _policy_tokens(x):
  x = np.asarray(x)
  return [list(x[i][MASK[i] > 0]) for i in range(3)]


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_weights_of_each_correction(kind):
  w = correction_weights(jnp.asarray(OLD), jnp.asarray(ROLLOUT), jnp.asarray(MASK), kind, CAP)
  for got, want in zip(_policy_tokens(w), EXPECTED[kind]):
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_policy_loss_scales_each_token_by_its_weight(kind):
  # On-policy (logp == old) with A = 1: the PPO per-token loss is -1, its gradient -1 per token; the
  # token-mean over the 7 policy tokens makes both -weight / 7.
  logp = jnp.asarray(OLD)
  adv = jnp.ones_like(logp)
  weights = np.concatenate([np.asarray(w, np.float64) for w in EXPECTED[kind]])
  fn = lambda lp: policy_loss(lp, logp, adv, jnp.asarray(MASK), rollout_logp=jnp.asarray(ROLLOUT),
                              is_correction=kind, is_cap=CAP)
  (loss, m), grad = jax.value_and_grad(fn, has_aux=True)(logp)
  np.testing.assert_allclose(loss, -weights.sum() / 7, rtol=1e-5)
  np.testing.assert_allclose(m["is_weight_mean"], weights.sum() / 7, rtol=1e-5)
  flat = np.concatenate(_policy_tokens(grad))
  np.testing.assert_allclose(flat, -weights / 7, rtol=1e-5)
  assert not np.asarray(grad)[MASK == 0].any()  # prompt and padding get no gradient


def _old_tis_cap_loss(logp, old_logp, adv, mask, rollout_logp, cap):
  """The policy loss as rl.tis_cap computed it before rl.is_correction (same ops, same order)."""
  logp = logp.astype(jnp.float32)
  old_logp = jax.lax.stop_gradient(old_logp.astype(jnp.float32))
  ratio = jnp.exp(logp - old_logp)
  loss_tok = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 0.8, 1.2))
  if cap is not None:
    tis_w = jnp.minimum(jnp.exp(old_logp - rollout_logp.astype(jnp.float32)), cap)
    loss_tok = loss_tok * jax.lax.stop_gradient(tis_w)
  return aggregate(loss_tok, mask, "token-mean")


@pytest.mark.parametrize("cap", [None, 1.3])
def test_none_and_token_tis_are_bitwise_the_former_loss(cap):
  rng = np.random.default_rng(0)
  old = jnp.asarray(rng.normal(-2.0, 0.5, (4, 9)), jnp.float32)
  logp = old + jnp.asarray(rng.normal(0, 0.3, (4, 9)), jnp.float32)
  rollout = old + jnp.asarray(rng.normal(0, 0.3, (4, 9)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=(4, 9)), jnp.float32)
  mask = jnp.asarray(rng.random((4, 9)) > 0.3, jnp.float32)
  kind = "none" if cap is None else "token_tis"
  new = jax.jit(jax.value_and_grad(lambda lp: policy_loss(
      lp, old, adv, mask, rollout_logp=rollout, is_correction=kind, is_cap=cap)[0]))
  former = jax.jit(jax.value_and_grad(lambda lp: _old_tis_cap_loss(lp, old, adv, mask, rollout, cap)))
  (a, ga), (b, gb) = new(logp), former(logp)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(ga, gb)


def test_seq_tis_caps_in_log_space_without_overflow():
  # 200 tokens of ratio e each: the product e^200 overflows fp32, the capped weight is just c.
  delta = jnp.ones((1, 200))
  w = correction_weights(delta, jnp.zeros((1, 200)), jnp.ones((1, 200)), "seq_tis", CAP)
  np.testing.assert_allclose(w, CAP, rtol=1e-6)


def test_a_correction_without_sampler_log_probs_is_an_error():
  with pytest.raises(ValueError, match="seq_mask.*sampler"):
    correction_weights(jnp.zeros((1, 2)), None, jnp.ones((1, 2)), "seq_mask", CAP)
  with pytest.raises(ValueError, match="'geo'.*token_tis"):
    correction_weights(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), "geo", CAP)


def test_mismatch_metrics_by_hand():
  r = np.array([2.0, 0.25, 1.5, 3.0, 1.2, 3.0, 3.0])  # the 7 policy tokens' ratios
  d = np.log(r)
  # [M, B, T] like the trainer's old log-probs next to the packed [N, T] rollout ones.
  m = mismatch_metrics(OLD.reshape(3, 1, 4), ROLLOUT, MASK, cap=CAP)
  np.testing.assert_allclose(m["mismatch/kl"], np.mean(r - 1 - d), rtol=1e-5)
  np.testing.assert_allclose(m["mismatch/kl_k1"], np.mean(-d), rtol=1e-5)
  np.testing.assert_allclose(m["mismatch/log_ratio_abs_max"], math.log(4.0), rtol=1e-5)
  np.testing.assert_allclose(m["mismatch/log_ratio_abs_mean"], np.mean(np.abs(d)), rtol=1e-5)
  np.testing.assert_allclose(m["mismatch/seq_log_ratio_abs_max"], math.log(9.0), rtol=1e-5)
  # Dropped policy tokens: token_mask 0.25, 3.0, 3.0, 3.0; seq_mask rows 1 and 2; geo_mask row 2.
  assert m["mismatch/token_mask_drop_frac"] == pytest.approx(4 / 7)
  assert m["mismatch/seq_mask_drop_frac"] == pytest.approx(4 / 7)
  assert m["mismatch/geo_mask_drop_frac"] == pytest.approx(2 / 7)


def test_mismatch_kl_of_a_small_mismatch_is_not_lost_to_rounding():
  # delta = 1e-4 on every token: KL = e^d - 1 - d = d^2 / 2 + d^3 / 6 = 5.0003e-9 (fp32 gives 0).
  old = np.full((2, 5), -3.0, np.float32)
  rollout = old - np.float32(1e-4)
  m = mismatch_metrics(old, rollout, np.ones((2, 5)), cap=CAP)
  delta = float(old[0, 0]) - float(rollout[0, 0])  # the fp32 inputs' exact difference
  np.testing.assert_allclose(m["mismatch/kl"], delta**2 / 2 + delta**3 / 6, rtol=1e-6)
  assert m["mismatch/token_mask_drop_frac"] == 0.0
