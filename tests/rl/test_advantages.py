"""Advantage estimators against hand-computed values (literals worked out outside the code)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlver_jax.rl.advantages import broadcast_sequence_advantage, gae, grpo_advantages, whiten

# Four groups, interleaved so the ids are not contiguous:
#   group 0: rewards 1, 0, 1, 0 -> mean 0.5, unbiased std sqrt(1/3)
#   group 1: single member 0.7  -> 0
#   group 2: 0.3, 0.3, 0.3      -> zero variance -> 0
#   group 3: 1, 2, 3            -> mean 2, unbiased std 1
REWARDS = [1.0, 0.3, 1.0, 0.7, 0.0, 2.0, 0.3, 1.0, 3.0, 0.0, 0.3]
GROUPS = [0, 2, 3, 1, 0, 3, 2, 0, 3, 0, 2]
A0 = 0.8660239037870368  # 0.5 / (sqrt(1/3) + 1e-6)
A3 = 0.9999990000010001  # 1 / (1 + 1e-6)


def test_grpo_std_normalised():
  adv = grpo_advantages(jnp.array(REWARDS), jnp.array(GROUPS))
  expected = [A0, 0.0, -A3, 0.0, -A0, 0.0, 0.0, A0, A3, -A0, 0.0]
  np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-7)
  # Zero-variance and single-member groups are exactly 0, not rounding noise.
  assert np.all(np.asarray(adv)[[1, 3, 6, 10]] == 0.0)


def test_grpo_mean_only():
  adv = grpo_advantages(jnp.array(REWARDS), jnp.array(GROUPS), mean_only=True)
  expected = [0.5, 0.0, -1.0, 0.0, -0.5, 0.0, 0.0, 0.5, 1.0, -0.5, 0.0]
  np.testing.assert_allclose(adv, expected, rtol=1e-6, atol=1e-7)


def test_grpo_zero_variance_with_inexact_mean_is_zero():
  # 0.1 * 3 / 3 != 0.1 in floating point; the advantage must still be exactly 0.
  adv = grpo_advantages(jnp.array([0.1, 0.1, 0.1]), jnp.array([0, 0, 0]))
  assert np.all(np.asarray(adv) == 0.0)


def test_grpo_valid_mask():
  rewards = jnp.array([1.0, 2.0, 3.0, 100.0, 5.0, -7.0])
  groups = jnp.array([0, 0, 0, 0, 1, 1])
  valid = jnp.array([1, 1, 1, 0, 1, 0])
  adv = grpo_advantages(rewards, groups, valid=valid)
  # Group 0 without the padded 100 is {1, 2, 3}; group 1 is left with one valid member.
  np.testing.assert_allclose(adv, [-A3, 0.0, A3, 0.0, 0.0, 0.0], rtol=1e-5, atol=1e-7)


def test_grpo_jit_with_static_num_groups():
  fn = jax.jit(functools.partial(grpo_advantages, num_groups=4, mean_only=True))
  adv = fn(jnp.array(REWARDS), jnp.array(GROUPS))
  np.testing.assert_allclose(adv[:3], [0.5, 0.0, -1.0], rtol=1e-6, atol=1e-7)


def test_gae_gamma_lambda_one_is_return_minus_value():
  # Terminal reward on the last policy token; user tokens (mask 0) carry junk values and rewards.
  mask = jnp.array([[1, 1, 0, 0, 1, 1, 0, 0]])
  values = jnp.array([[0.1, 0.4, 9.0, -9.0, 0.5, 0.8, 9.0, 9.0]])
  rewards = jnp.array([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
  adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
  np.testing.assert_allclose(adv, [[0.9, 0.6, 0, 0, 0.5, 0.2, 0, 0]], atol=1e-6)
  np.testing.assert_allclose(ret, [[1.0, 1.0, 0, 0, 1.0, 1.0, 0, 0]], atol=1e-6)


def test_gae_hand_worked_skips_user_tokens():
  # Row 0: policy turn at t=0,1 (turn reward 0.5 at t=1), user tokens t=2,3, policy turn t=4,5
  #   (turn reward 1.0 at t=5), padding t=6. gamma=0.9, lam=0.8, gamma*lam=0.72:
  #   t=5: delta = 1.0 + 0.9*0 - 0.6 = 0.4                       A = 0.4
  #   t=4: delta = 0 + 0.9*0.6 - 0.4 = 0.14                      A = 0.14 + 0.72*0.4 = 0.428
  #   t=1: delta = 0.5 + 0.9*0.4 - 0.3 = 0.56 (bootstrap V(t=4)) A = 0.56 + 0.72*0.428 = 0.86816
  #   t=0: delta = 0 + 0.9*0.3 - 0.2 = 0.07                      A = 0.07 + 0.72*0.86816 = 0.6950752
  # Row 1: policy at t=1 and t=5 only, terminal reward 2 at t=5:
  #   t=5: A = 2 - 1 = 1;  t=1: delta = 0 + 0.9*1 - 0.5 = 0.4, A = 0.4 + 0.72*1 = 1.12
  mask = jnp.array([[1, 1, 0, 0, 1, 1, 0], [0, 1, 0, 0, 0, 1, 0]])
  values = jnp.array([[0.2, 0.3, 9.0, 9.0, 0.4, 0.6, 9.0], [5.0, 0.5, 5.0, 5.0, 5.0, 1.0, 5.0]])
  rewards = jnp.array([[0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0]])
  adv, ret = jax.jit(functools.partial(gae, gamma=0.9, lam=0.8))(rewards, values, mask)
  np.testing.assert_allclose(
      adv, [[0.6950752, 0.86816, 0, 0, 0.428, 0.4, 0], [0, 1.12, 0, 0, 0, 1.0, 0]], atol=1e-6)
  np.testing.assert_allclose(
      ret, [[0.8950752, 1.16816, 0, 0, 0.828, 1.0, 0], [0, 1.62, 0, 0, 0, 2.0, 0]], atol=1e-6)


def test_gae_rewards_on_masked_positions_are_ignored():
  mask = jnp.array([[1, 0, 1]])
  values = jnp.zeros((1, 3))
  adv, _ = gae(jnp.array([[0.0, 7.0, 1.0]]), values, mask, gamma=0.5, lam=1.0)
  # t=2: A = 1; t=0: A = 0 + 0.5*0 - 0 + 0.5*1 = 0.5 (the 7 on the user token is not seen).
  np.testing.assert_allclose(adv, [[0.5, 0.0, 1.0]], atol=1e-7)


def test_whiten_unbiased():
  x = jnp.array([1.0, 2.0, 3.0, 4.0, 100.0])
  mask = jnp.array([1, 1, 1, 1, 0])
  # mean 2.5, unbiased variance 5/3.
  np.testing.assert_allclose(
      whiten(x, mask), [-1.161895, -0.38729833, 0.38729833, 1.161895, 0.0], rtol=1e-5)
  np.testing.assert_allclose(
      jax.jit(functools.partial(whiten, shift_mean=False))(x, mask),
      [1.338105, 2.11270167, 2.88729833, 3.661895, 0.0], rtol=1e-5)


def test_whiten_single_token_is_finite():
  out = whiten(jnp.array([3.0, 1.0]), jnp.array([1, 0]))
  np.testing.assert_array_equal(out, [0.0, 0.0])


def test_broadcast_sequence_advantage():
  out = broadcast_sequence_advantage(jnp.array([2.0, -1.0]), jnp.array([[0, 1, 1], [1, 0, 1]]))
  np.testing.assert_array_equal(out, [[0.0, 2.0, 2.0], [-1.0, 0.0, -1.0]])


@pytest.mark.parametrize("mean_only", [False, True])
def test_grpo_matches_numpy_reference_on_random_groups(mean_only):
  rng = np.random.default_rng(0)
  rewards = rng.normal(size=40).astype(np.float32)
  groups = rng.integers(0, 8, size=40)
  adv = np.asarray(grpo_advantages(jnp.array(rewards), jnp.array(groups), num_groups=8,
                                   mean_only=mean_only))
  for g in range(8):
    sel = groups == g
    r = rewards[sel].astype(np.float64)
    if sel.sum() < 2:
      expected = np.zeros_like(r)
    elif mean_only:
      expected = r - r.mean()
    else:
      expected = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(adv[sel], expected, rtol=1e-4, atol=1e-5)
