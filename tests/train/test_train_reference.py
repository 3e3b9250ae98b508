"""The trainer's optional terms on real rollouts: KL to the reference (in the loss for GRPO, in the
rewards for PPO) and truncated importance sampling against the sampler's log-probs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny_world
from rlver_jax.train import loop as train
from rlver_jax.rl import advantages as adv_lib
from rlver_jax.rl.losses import kl_penalty
from rlver_jax.parallel.sharding import host_array


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


_config = tiny_world.training_config


def _batch(trainer, step):
  with jax.set_mesh(trainer.mesh):
    dialogues, _ = trainer.rollout(jax.random.key(step))
    batch, extra = trainer.make_batch(dialogues)
  return dialogues, batch, extra


def _np(x):
  return np.asarray(host_array(x), np.float64)


def _pretrained_logp(trainer, pretrained, batch):
  with jax.set_mesh(trainer.mesh):
    return _np(trainer._logp_fn(pretrained, batch.tokens, batch.segment_ids))


def test_grpo_kl_term_anchors_to_the_pretrained_policy_across_a_resume(world, tmp_path):
  config = _config(world, "grpo", total_steps=3, **{"rl.kl_coef": 0.5, "optim.actor_lr": 1e-3})
  trainer = tiny_world.trainer(config, str(tmp_path))
  pretrained = jax.tree.map(jnp.copy, trainer.state.policy)

  _, batch, extra = _batch(trainer, 0)
  mask = _np(batch.loss_mask) > 0
  # Before any update the policy is the reference: the same log-probs, a zero KL.
  np.testing.assert_array_equal(_np(batch.ref_logp), _np(batch.old_logp))
  assert extra["kl_ref"] == 0.0
  with jax.set_mesh(trainer.mesh):
    m = trainer.update(batch)
  assert abs(m["kl_loss"]) < 1e-6
  for _ in range(2):
    trainer.train_step()
  trainer.save()
  trainer.checkpointer.wait()

  # A resumed trainer must keep the pretrained weights as its reference, not the restored policy.
  resumed = tiny_world.trainer(config, str(tmp_path))
  assert resumed.restore_if_any() and resumed.step == 2
  _, batch, extra = _batch(resumed, 5)
  mask = _np(batch.loss_mask) > 0
  ref, old = _np(batch.ref_logp), _np(batch.old_logp)
  np.testing.assert_allclose(ref[mask], _pretrained_logp(resumed, pretrained, batch)[mask], atol=1e-6)
  assert np.abs(old - ref)[mask].max() > 1e-3  # the policy has moved away from it
  np.testing.assert_allclose(extra["kl_ref"], (old - ref)[mask].mean(), rtol=1e-4)

  # With zero advantages the only gradient is the KL term's: updates must pull the policy back.
  # (A fresh optimizer state: Adam's momentum from the reward-driven steps would first carry on.)
  pull = dataclasses.replace(batch, advantages=jnp.zeros_like(batch.advantages))
  with jax.set_mesh(resumed.mesh):
    resumed.state = dataclasses.replace(resumed.state,
                                        policy_opt=resumed.policy_up.init(resumed.state.policy))
    kls = [resumed.update(pull)["kl_loss"] for _ in range(4)]
  k3 = np.asarray(kl_penalty(jnp.asarray(old), jnp.asarray(ref), "k3"))
  np.testing.assert_allclose(kls[0], k3[mask].mean(), rtol=1e-3)  # token-mean k3 at the old policy
  assert kls[-1] < 0.7 * kls[0], kls
  resumed.checkpointer.close()
  trainer.checkpointer.close()


def test_ppo_kl_in_reward_subtracts_each_tokens_penalty_from_its_reward(world, tmp_path):
  coef = 0.2
  config = _config(world, "ppo", total_steps=1, **{"rl.kl_coef": coef, "rl.kl_in_reward": True,
                                                    "rl.whiten_advantages": False})
  trainer = tiny_world.trainer(config, str(tmp_path))
  # A reference that differs from the policy (as after some training): every weight scaled.
  trainer.state = dataclasses.replace(
      trainer.state, reference=jax.tree.map(lambda x: x * 1.05, trainer.state.policy))
  with jax.set_mesh(trainer.mesh):
    dialogues, _ = trainer.rollout(jax.random.key(0))
    with_kl, extra = trainer.make_batch(dialogues)
    ref_logp = trainer._logp_fn(trainer.ref, with_kl.tokens, with_kl.segment_ids)
    saved = trainer.ref
    trainer.state = dataclasses.replace(trainer.state, reference=None)
    without, _ = trainer.make_batch(dialogues)
  assert with_kl.ref_logp is None  # the KL went into the rewards, not the loss
  mask = _np(with_kl.loss_mask)
  old, ref = _np(with_kl.old_logp), _np(ref_logp)
  penalty = coef * np.asarray(kl_penalty(jnp.asarray(old), jnp.asarray(ref), "k3")) * mask
  assert penalty.sum() > 0 and saved is not None
  np.testing.assert_allclose(extra["kl_ref"], ((old - ref) * mask).sum() / mask.sum(), rtol=1e-4)
  # GAE is linear in the rewards for fixed values, so the returns move by the GAE of -penalty alone.
  shape = mask.shape
  flat = lambda a: jnp.asarray(a.reshape(-1, shape[-1]), jnp.float32)
  _, delta = adv_lib.gae(flat(-penalty), jnp.zeros_like(flat(mask)), flat(mask),
                         gamma=config.rl.gamma, lam=config.rl.lam)
  moved = (_np(with_kl.returns) - _np(without.returns)).reshape(-1, shape[-1])
  np.testing.assert_allclose(moved, np.asarray(delta), atol=1e-5)
  trainer.checkpointer.close()


def test_truncated_importance_weights_use_the_samplers_log_probs(world, tmp_path):
  cap = 1.05  # low enough that some tokens are capped
  config = _config(world, "grpo", total_steps=1, **{"policy.temperature": 0.7,
                                                      "rl.is_correction": "token_tis", "rl.is_cap": cap})
  trainer = tiny_world.trainer(config, str(tmp_path))
  _, batch, _ = _batch(trainer, 0)
  mask = _np(batch.loss_mask) > 0
  old, rollout = _np(batch.old_logp)[mask], _np(batch.rollout_logp)[mask]
  # The sampler drew at T=0.7, so its log-probs are not the model's: the weights are not all 1.
  weights = np.minimum(np.exp(old - rollout), cap)
  assert weights.min() < 0.9 and weights.max() == cap
  with jax.set_mesh(trainer.mesh):
    m = trainer.update(batch)
  np.testing.assert_allclose(m["is_weight_mean"], weights.mean(), rtol=1e-4)
  trainer.checkpointer.close()
