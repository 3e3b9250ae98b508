"""GSPO and CISPO against hand-computed losses and gradients, and GSPO == PPO on one-token samples.

Clip range (1 - 0.2, 1 + 0.28) = (0.8, 1.28) throughout.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlver_jax.rl.losses import policy_loss

CLIP = dict(clip_low=0.2, clip_high=0.28)

# GSPO: row 0 has token ratios 1.2, 1.5, 0.8 (A = +1), row 1 has 0.5, 0.9 (A = -2), then padding.
#   s0 = (1.2 * 1.5 * 0.8)^(1/3) = 1.44^(1/3) = 1.12924  inside (0.8, 1.28): loss -A s0 = -1.12924
#   s1 = (0.5 * 0.9)^(1/2) = 0.45^(1/2) = 0.67082        below 0.8 with A < 0: max(2 s1, 2 * 0.8) = 1.6
G_RATIOS = np.array([[1.2, 1.5, 0.8], [0.5, 0.9, 7.0]])
G_MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
G_ADV = np.array([[1.0] * 3, [-2.0] * 3], np.float32)
S0, S1 = 1.44 ** (1 / 3), 0.45**0.5


def _arrays(ratios, old):
  old = jnp.asarray(old, jnp.float32)
  return old + jnp.log(jnp.asarray(ratios, jnp.float32)), old


def test_gspo_sequence_mean_is_the_gspo_objective():
  logp, old = _arrays(G_RATIOS, np.full((2, 3), -1.5))
  fn = lambda lp: policy_loss(lp, old, jnp.asarray(G_ADV), jnp.asarray(G_MASK), kind="gspo",
                              agg="seq-mean-token-mean", **CLIP)
  (loss, m), grad = jax.value_and_grad(fn, has_aux=True)(logp)
  np.testing.assert_allclose(loss, (-S0 + 1.6) / 2, rtol=1e-5)
  # d(-A s0)/d logp_t = -A s0 / 3 for each of row 0's tokens, halved by the mean over 2 sequences;
  # row 1 is clipped: no gradient.
  np.testing.assert_allclose(grad, [[-S0 / 6] * 3, [0.0, 0.0, 0.0]], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(m["clip_frac"], 2 / 5, rtol=1e-6)  # row 1's two tokens of 5
  np.testing.assert_allclose(m["ratio_max"], S0, rtol=1e-5)
  np.testing.assert_allclose(m["ratio_min"], S1, rtol=1e-5)
  # approx_kl stays per token: mean of 0.5 * log(r)^2 over the 5 policy tokens.
  kl = np.mean([0.5 * math.log(r) ** 2 for r in (1.2, 1.5, 0.8, 0.5, 0.9)])
  np.testing.assert_allclose(m["approx_kl"], kl, rtol=1e-5)


def test_gspo_token_mean_weighs_sequences_by_length():
  logp, old = _arrays(G_RATIOS, np.full((2, 3), -1.5))
  loss, _ = policy_loss(logp, old, jnp.asarray(G_ADV), jnp.asarray(G_MASK), kind="gspo", **CLIP)
  np.testing.assert_allclose(loss, (3 * -S0 + 2 * 1.6) / 5, rtol=1e-5)


@pytest.mark.parametrize("dual_clip,agg", [(None, "token-mean"), (3.0, "seq-mean-token-mean")])
def test_gspo_equals_ppo_on_one_token_samples(dual_clip, agg):
  # Each row holds one policy token (at different places) among prompt tokens and padding.
  rng = np.random.default_rng(1)
  old = jnp.asarray(rng.normal(-2.0, 0.5, (6, 4)), jnp.float32)
  logp = old + jnp.asarray(rng.normal(0, 0.4, (6, 4)), jnp.float32)  # ratios across both clips
  adv = jnp.asarray(np.repeat(rng.normal(size=(6, 1)), 4, axis=1), jnp.float32)
  mask = np.zeros((6, 4), np.float32)
  mask[np.arange(6), [1, 2, 3, 1, 2, 3]] = 1
  mask = jnp.asarray(mask)

  def run(kind):
    fn = lambda lp: policy_loss(lp, old, adv, mask, kind=kind, dual_clip=dual_clip, agg=agg, **CLIP)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(logp)

  (l_ppo, m_ppo), g_ppo = run("ppo")
  (l_gspo, m_gspo), g_gspo = run("gspo")
  np.testing.assert_array_equal(l_gspo, l_ppo)
  np.testing.assert_array_equal(g_gspo, g_ppo)
  assert float(m_ppo["clip_frac"]) > 0
  for k in m_ppo:
    np.testing.assert_array_equal(m_gspo[k], m_ppo[k])


def test_cispo_by_hand():
  # Ratios 1.1, 1.5, 0.5 with A = 2, 2, -1: clipped weights 1.1, 1.28, 0.8. Loss per token
  # -w * A * logp; its gradient -w * A / 3 keeps flowing on the clipped tokens (PPO's would be 0).
  logp, old = _arrays([[1.1, 1.5, 0.5]], [[-1.0, -2.0, -0.5]])
  adv = jnp.asarray([[2.0, 2.0, -1.0]])
  fn = lambda lp: policy_loss(lp, old, adv, jnp.ones((1, 3)), kind="cispo", **CLIP)
  (loss, m), grad = jax.value_and_grad(fn, has_aux=True)(logp)
  lp = np.asarray(logp)[0]  # = old + log r
  want = (-1.1 * 2 * lp[0] - 1.28 * 2 * lp[1] + 0.8 * lp[2]) / 3
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(grad, [[-2.2 / 3, -2.56 / 3, 0.8 / 3]], rtol=1e-5)
  np.testing.assert_allclose(m["clip_frac"], 2 / 3, rtol=1e-6)


def test_on_policy_every_loss_has_the_same_gradient():
  # At r = 1 the gradient is -A grad logp for ppo, gspo (s = 1) and cispo (weight 1) alike.
  rng = np.random.default_rng(2)
  old = jnp.asarray(rng.normal(-2.0, 0.5, (3, 5)), jnp.float32)
  adv = jnp.asarray(np.repeat(rng.normal(size=(3, 1)), 5, axis=1), jnp.float32)
  mask = jnp.asarray(rng.random((3, 5)) > 0.3, jnp.float32)
  grads = [jax.grad(lambda lp: policy_loss(lp, old, adv, mask, kind=k, **CLIP)[0])(old)
           for k in ("ppo", "gspo", "cispo")]
  for g in grads[1:]:
    np.testing.assert_allclose(g, grads[0], rtol=1e-6, atol=1e-8)


def test_unknown_loss_and_dual_clip_with_cispo_are_errors():
  x = jnp.zeros((1, 2))
  with pytest.raises(ValueError, match="'gpo'.*ppo, gspo, cispo"):
    policy_loss(x, x, x, jnp.ones((1, 2)), kind="gpo")
  with pytest.raises(ValueError, match="dual_clip.*cispo"):
    policy_loss(x, x, x, jnp.ones((1, 2)), kind="cispo", dual_clip=3.0)
