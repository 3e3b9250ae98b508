"""Losses against hand-computed values (literals worked out outside the code)."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlver_jax.rl.losses import (aggregate, entropy_bonus, entropy_from_logits, explained_variance,
                                 kl_loss, kl_penalty, policy_loss, token_logprobs, value_loss)

# One token per case, clip range (1 - 0.2, 1 + 0.28) = (0.8, 1.28); per-token loss is
# max(-A*r, -A*clip(r)):
#   A=+2: r=1.1 inside -> -2.2;  r=1.5 above -> -2.56 (clipped);  r=0.5 below -> -1.0
#   A=-1: r=1.1 inside ->  1.1;  r=1.5 above ->  1.5;             r=0.5 below ->  0.8 (clipped)
RATIOS = [1.1, 1.5, 0.5, 1.1, 1.5, 0.5]
ADVS = [2.0, 2.0, 2.0, -1.0, -1.0, -1.0]
PER_TOKEN = [-2.2, -2.56, -1.0, 1.1, 1.5, 0.8]
CLIPPED = [False, True, False, False, False, True]


def _case_arrays(ratios, advs):
  logp = jnp.log(jnp.array([ratios], jnp.float32))
  return logp, jnp.zeros_like(logp), jnp.array([advs], jnp.float32)


@pytest.mark.parametrize("i", range(6))
def test_policy_loss_each_clip_case(i):
  logp, old, adv = _case_arrays([RATIOS[i]], [ADVS[i]])
  loss, m = policy_loss(logp, old, adv, jnp.ones((1, 1)), clip_low=0.2, clip_high=0.28)
  np.testing.assert_allclose(loss, PER_TOKEN[i], rtol=1e-5)
  assert float(m["clip_frac"]) == float(CLIPPED[i])


def test_policy_loss_token_mean_and_metrics():
  logp, old, adv = _case_arrays(RATIOS + [9.0], ADVS + [5.0])
  mask = jnp.array([[1, 1, 1, 1, 1, 1, 0]])  # the last token is padding and must not count
  loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
  np.testing.assert_allclose(loss, sum(PER_TOKEN) / 6, rtol=1e-5)
  np.testing.assert_allclose(m["clip_frac"], 2 / 6, rtol=1e-6)
  np.testing.assert_allclose(m["ratio_mean"], sum(RATIOS) / 6, rtol=1e-5)
  np.testing.assert_allclose(m["ratio_max"], 1.5, rtol=1e-6)
  np.testing.assert_allclose(m["ratio_min"], 0.5, rtol=1e-6)
  # approx_kl is k2: mean of 0.5 * log(r)^2.
  expected_kl = sum(0.5 * math.log(r) ** 2 for r in RATIOS) / 6
  np.testing.assert_allclose(m["approx_kl"], expected_kl, rtol=1e-5)
  assert float(m["dual_clip_frac"]) == 0.0


def test_policy_loss_dual_clip():
  # dual_clip = 3, A = -1: r=5 -> max(5, 1.2) = 5, capped at 3 (active);
  # r=2 -> 2 < 3 (inactive); A=+1, r=5 -> max(-5, -1.2) = -1.2 (dual clip never applies to A > 0).
  logp, old, adv = _case_arrays([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
  per_token = []
  for j in range(3):
    loss, m = policy_loss(logp[:, j:j + 1], old[:, j:j + 1], adv[:, j:j + 1], jnp.ones((1, 1)),
                          dual_clip=3.0)
    per_token.append(float(loss))
  np.testing.assert_allclose(per_token, [3.0, 2.0, -1.2], rtol=1e-5)
  loss, m = policy_loss(logp, old, adv, jnp.ones((1, 3)), dual_clip=3.0)
  np.testing.assert_allclose(loss, (3.0 + 2.0 - 1.2) / 3, rtol=1e-5)
  np.testing.assert_allclose(m["dual_clip_frac"], 1 / 3, rtol=1e-6)
  # Without the dual clip the first token would cost 5.
  loss_plain, _ = policy_loss(logp, old, adv, jnp.ones((1, 3)))
  np.testing.assert_allclose(loss_plain, (5.0 + 2.0 - 1.2) / 3, rtol=1e-5)


def test_policy_loss_rejects_dual_clip_not_above_one():
  logp, old, adv = _case_arrays([1.0], [1.0])
  with pytest.raises(ValueError, match="dual_clip"):
    policy_loss(logp, old, adv, jnp.ones((1, 1)), dual_clip=0.9)


def test_policy_loss_gradient_zero_on_clipped_tokens():
  ratios = RATIOS + [5.0]
  advs = ADVS + [-1.0]
  logp, old, adv = _case_arrays(ratios, advs)
  mask = jnp.ones((1, 7))

  def f(lp):
    return policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)[0]

  grad = np.asarray(jax.grad(f)(logp))[0]
  # d/dlogp of -A*r is -A*r on active-unclipped tokens, divided by 7 tokens; clipped tokens
  # (index 1, 5) and the dual-clipped token (index 6) get exactly 0.
  expected = [-2 * 1.1 / 7, 0.0, -2 * 0.5 / 7, 1.1 / 7, 1.5 / 7, 0.0, 0.0]
  np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=0)
  assert grad[1] == 0.0 and grad[5] == 0.0 and grad[6] == 0.0


def test_policy_loss_truncated_importance_sampling():
  # ratio 1 (logp == old), A = +1 -> per-token loss -1, scaled by min(exp(old - rollout), 2):
  #   old - rollout = log 0.5 -> 0.5;  log 4 -> capped at 2;  0 -> 1.
  logp = jnp.zeros((1, 3))
  rollout = -jnp.log(jnp.array([[0.5, 4.0, 1.0]]))
  adv = jnp.ones((1, 3))
  mask = jnp.ones((1, 3))
  tis = dict(rollout_logp=rollout, is_correction="token_tis", is_cap=2.0)
  loss, m = policy_loss(logp, logp, adv, mask, **tis)
  np.testing.assert_allclose(loss, -(0.5 + 2.0 + 1.0) / 3, rtol=1e-5)
  np.testing.assert_allclose(m["is_weight_mean"], 3.5 / 3, rtol=1e-5)
  # The weight scales the gradient but is itself not differentiated.
  grad = jax.grad(lambda lp: policy_loss(lp, logp, adv, mask, **tis)[0])(logp)
  np.testing.assert_allclose(grad, [[-0.5 / 3, -2.0 / 3, -1.0 / 3]], rtol=1e-5)
  # rollout_logp without a correction leaves the loss unweighted.
  loss_off, m_off = policy_loss(logp, logp, adv, mask, rollout_logp=rollout)
  np.testing.assert_allclose(loss_off, -1.0, rtol=1e-6)
  assert "is_weight_mean" not in m_off


LOSS = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
MASK = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("mode,norm_len,expected", [
    ("token-mean", None, 17 / 5),                       # (1+2+3+5+6) / 5
    ("seq-mean-token-mean", None, (6 / 3 + 11 / 2) / 2),  # empty third row excluded
    ("seq-mean-token-sum-norm", None, (6 / 4 + 11 / 4) / 2),  # normalised by T = 4
    ("seq-mean-token-sum-norm", 10, (6 / 10 + 11 / 10) / 2),
])
def test_aggregate_modes(mode, norm_len, expected):
  fn = jax.jit(functools.partial(aggregate, mode=mode, norm_len=norm_len))
  np.testing.assert_allclose(fn(LOSS, MASK), expected, rtol=1e-6)


def test_aggregate_unknown_mode():
  with pytest.raises(ValueError, match="'seq-sum'.*token-mean.*seq-mean-token-mean"):
    aggregate(LOSS, MASK, "seq-sum")


def test_value_loss_clip_cases():
  # old = 1, R = 2, clip_eps = 0.5 -> v clipped into [0.5, 1.5]; 0.5 * max(err, err_clipped):
  #   v=1.2 inside:        0.5*0.64 = 0.32
  #   v=2.0 above:         max(0, (1.5-2)^2 = 0.25) -> 0.125 (clipped branch active)
  #   v=0.0 below:         max(4, (0.5-2)^2 = 2.25) -> 2.0
  #   v=3.0 above:         max(1, 0.25) -> 0.5
  values = jnp.array([[1.2, 2.0, 0.0, 3.0, 50.0]])
  old = jnp.ones((1, 5))
  ret = jnp.full((1, 5), 2.0)
  mask = jnp.array([[1, 1, 1, 1, 0]])
  loss, m = jax.jit(value_loss)(values, old, ret, mask)
  np.testing.assert_allclose(loss, (0.32 + 0.125 + 2.0 + 0.5) / 4, rtol=1e-5)
  np.testing.assert_allclose(m["vf_clip_frac"], 0.25, rtol=1e-6)
  loss_unclipped, _ = value_loss(values, old, ret, mask, clip_eps=None)
  np.testing.assert_allclose(loss_unclipped, 0.5 * (0.64 + 0 + 4 + 1) / 4, rtol=1e-5)
  # The clipped branch carries no gradient to v.
  grad = jax.grad(lambda v: value_loss(v, old, ret, mask)[0])(values)
  np.testing.assert_allclose(grad, [[(1.2 - 2) / 4, 0.0, (0 - 2) / 4, (3 - 2) / 4, 0.0]], atol=1e-6)


def test_explained_variance():
  # R - V = [-0.5, 0, 0.5, 0]: var 0.125; var(R) = 1.25 -> 1 - 0.1 = 0.9. Padding ignored.
  ret = jnp.array([[1.0, 2.0, 3.0, 4.0, 99.0]])
  values = jnp.array([[1.5, 2.0, 2.5, 4.0, -99.0]])
  np.testing.assert_allclose(explained_variance(values, ret, jnp.array([[1, 1, 1, 1, 0]])), 0.9, rtol=1e-5)
  # Returns constant over the masked tokens (one row at gamma = 1): 0, not a division by zero.
  assert float(explained_variance(values, jnp.full_like(ret, 0.7), jnp.ones_like(ret))) == 0.0


def test_kl_estimators():
  logp = jnp.array([-1.0, -2.0, -1.5])
  ref = jnp.array([-2.0, -1.0, -1.5])
  np.testing.assert_allclose(kl_penalty(logp, ref, "k1"), [1.0, -1.0, 0.0], atol=1e-7)
  np.testing.assert_allclose(kl_penalty(logp, ref, "k2"), [0.5, 0.5, 0.0], atol=1e-7)
  # k3 = exp(ref - logp) - (ref - logp) - 1: exp(-1) + 1 - 1 = 0.36787944; e - 1 - 1 = 0.71828183.
  np.testing.assert_allclose(kl_penalty(logp, ref, "k3"), [0.36787944, 0.71828183, 0.0], rtol=1e-6)
  with pytest.raises(ValueError, match="'k4'.*k1, k2, k3"):
    kl_penalty(logp, ref, "k4")


def test_k3_nonnegative():
  rng = np.random.default_rng(0)
  logp = jnp.array(rng.normal(scale=3.0, size=1000), jnp.float32)
  ref = jnp.array(rng.normal(scale=3.0, size=1000), jnp.float32)
  assert float(kl_penalty(logp, ref, "k3").min()) >= 0.0


def test_kl_loss_aggregates_over_mask():
  logp = jnp.array([[-1.0, -2.0, 0.0]])
  ref = jnp.array([[-2.0, -1.0, -5.0]])
  mask = jnp.array([[1, 1, 0]])
  fn = jax.jit(functools.partial(kl_loss, kind="k3", agg="token-mean"))
  np.testing.assert_allclose(fn(logp, ref, mask), (0.36787944 + 0.71828183) / 2, rtol=1e-6)


def test_entropy_and_logprobs():
  # Row 0: uniform over 4 -> H = log 4. Row 1: p = (0.25, 0.75, ~0, ~0) (-1e9 logits)
  # -> H = 0.25*log 4 + 0.75*log(4/3) = 0.56233514.
  lf = jnp.array([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]], jnp.float32)
  ent = jax.jit(entropy_from_logits)(lf)
  np.testing.assert_allclose(ent, [[1.38629436, 0.56233514]], rtol=1e-6)
  np.testing.assert_allclose(entropy_bonus(ent, jnp.array([[1, 0]])), 1.38629436, rtol=1e-6)
  # bf16 logits come back as fp32 (values only as exact as bf16's log 3).
  ent_bf16 = entropy_from_logits(lf.astype(jnp.bfloat16))
  assert ent_bf16.dtype == jnp.float32
  np.testing.assert_allclose(ent_bf16, [[1.38629436, 0.56233514]], rtol=1e-2)

  lp = jax.jit(token_logprobs)(lf, jnp.array([[2, 1]]))
  assert lp.dtype == jnp.float32
  np.testing.assert_allclose(lp, [[-1.38629436, -0.28768207]], rtol=1e-6)
  np.testing.assert_allclose(token_logprobs(lf, jnp.array([[0, 0]])), [[-1.38629436, -1.38629436]],
                             rtol=1e-6)
  assert token_logprobs(lf.astype(jnp.bfloat16), jnp.array([[2, 1]])).dtype == jnp.float32


def test_policy_loss_jit_matches_eager():
  logp, old, adv = _case_arrays(RATIOS, ADVS)
  mask = jnp.ones((1, 6))
  fn = jax.jit(functools.partial(policy_loss, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                                 agg="seq-mean-token-sum-norm", norm_len=12))
  loss, m = fn(logp, old, adv, mask)
  np.testing.assert_allclose(loss, sum(PER_TOKEN) / 12, rtol=1e-5)
  np.testing.assert_allclose(m["clip_frac"], 2 / 6, rtol=1e-6)
