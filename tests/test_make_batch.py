"""From real rollouts to the update's inputs: where rewards land, which advantage each packed row
gets (think mode makes one sample per turn), whitening, explained variance, and an on-policy first
update. Checked against numpy recomputations from the dialogues themselves."""

import jax
import numpy as np
import pytest

import tiny_world
from rlver_jax import train
from rlver_jax.sharding import host_array


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


def _rollout_and_batch(world, tmp_path, algo, **extra):
  config = tiny_world.training_config(world, algo, **{"total_steps": 1, **extra})
  trainer = train.Trainer(config, str(tmp_path))
  with jax.set_mesh(trainer.mesh):
    dialogues, _ = trainer.rollout(jax.random.key(3))
    batch, extra_metrics = trainer.make_batch(dialogues)
  flat = lambda k: np.asarray(host_array(batch[k])).reshape(-1, batch[k].shape[-1])
  return trainer, dialogues, batch, extra_metrics, flat


def test_think_mode_rows_carry_their_turns_tokens_reward_and_dialogues_advantage(world, tmp_path):
  trainer, dialogues, batch, _, flat = _rollout_and_batch(
      world, tmp_path, "grpo", **{"policy.think": True, "simulator.max_turns": 3})
  samples = [(i, s) for i, d in enumerate(dialogues) for s in d.samples]
  assert len(samples) > len(dialogues)  # several turns, one sample each
  p = train.pack(dialogues, 1, trainer.chat.pad_id)
  mask, adv = flat("loss_mask"), flat("advantages")
  rewards = np.array([d.reward for d in dialogues])
  groups = np.array([d.group_id for d in dialogues])
  for row, (i, s) in enumerate(samples):
    n = len(s.tokens)
    np.testing.assert_array_equal(flat("tokens")[row, :n], s.tokens)
    np.testing.assert_array_equal(mask[row, :n], s.loss_mask)
    np.testing.assert_allclose(flat("rollout_logp")[row, :n], s.sampler_logp)
    assert not mask[row, n:].any()
    # The reward sits on the turn's last sampled token, a policy token, and nowhere else.
    (where,) = np.nonzero(p.rewards[row])
    assert list(where) in ([], [s.turn_ends[-1]]) and mask[row, s.turn_ends[-1]] == 1
    assert p.rewards[row, s.turn_ends[-1]] == pytest.approx(dialogues[i].reward)
    # GRPO: the dialogue's group-normalised reward on every policy token of each of its turns.
    same = rewards[groups == groups[i]]
    expected = (rewards[i] - same.mean()) / (same.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(adv[row, :n], expected * mask[row, :n], rtol=1e-5, atol=1e-6)
  assert not mask[len(samples):].any()

  with jax.set_mesh(trainer.mesh):
    m = trainer.update(batch)
  # The first update runs at the rollout's own policy: every ratio is 1 and nothing is clipped.
  assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
  assert m["ratio_max"] == pytest.approx(1.0, abs=1e-4) and m["clip_frac"] == 0.0
  trainer.checkpointer.close()


def test_ppo_advantages_are_whitened_over_policy_tokens_and_ev_is_whole_batch(world, tmp_path):
  trainer, _, batch, extra, flat = _rollout_and_batch(world, tmp_path, "ppo")
  mask = flat("loss_mask") > 0
  adv = flat("advantages")
  assert not adv[~mask].any()
  np.testing.assert_allclose(adv[mask].mean(), 0.0, atol=1e-5)
  np.testing.assert_allclose(adv[mask].std(ddof=1), 1.0, rtol=1e-4)  # whiten uses ddof=1
  ret, v = flat("returns")[mask], flat("old_values")[mask]
  np.testing.assert_allclose(extra["critic/explained_variance"], 1 - np.var(ret - v) / np.var(ret),
                             rtol=1e-4, atol=1e-6)
  trainer.checkpointer.close()
