"""From real rollouts to the update's inputs: where rewards land, which advantage each packed row
gets (think mode makes one sample per turn), whitening, explained variance, and an on-policy first
update. Checked against numpy recomputations from the dialogues themselves."""

import jax
import numpy as np
import pytest

import tiny_world
from rlver_jax.parallel.sharding import host_array
from rlver_jax.rl.pack import pack
from rlver_jax.train import loop as train


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


def _rollout_and_batch(world, tmp_path, algo, **extra):
  config = tiny_world.training_config(world, algo, **{"total_steps": 1, **extra})
  trainer = tiny_world.trainer(config, str(tmp_path))
  with jax.set_mesh(trainer.mesh):
    dialogues, _ = trainer.rollout(jax.random.key(3))
    batch, extra_metrics = trainer.make_batch(dialogues)
  flat = lambda k: np.asarray(host_array(getattr(batch, k))).reshape(-1, batch.tokens.shape[-1])
  return trainer, dialogues, batch, extra_metrics, flat


def test_think_mode_rows_carry_their_turns_tokens_reward_and_dialogues_advantage(world, tmp_path):
  trainer, dialogues, batch, _, flat = _rollout_and_batch(
      world, tmp_path, "grpo", **{"policy.think": True, "simulator.max_turns": 3,
                                  "rl.mini_batch_rows": 0,  # rows in sample order,
                                  "rl.pack_update": False})  # one a row
  samples = [(i, s) for i, d in enumerate(dialogues) for s in d.samples]
  assert len(samples) > len(dialogues)  # several turns, one sample each
  p = pack(dialogues, 1, trainer.chat.pad_id)
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


# One sample a row: the plan's shape is then the trainer's; packed rows (the default) are fewer
# (test_packed_update), so there only fields, dtypes, shardings and an upper bound are compared.
@pytest.mark.parametrize("algo,extra", [("grpo", {"rl.kl_coef": 0.1, "rl.pack_update": False}),
                                        ("ppo", {"rl.pack_update": False}),
                                        ("ppo", {})])
def test_trainers_batch_is_the_abstract_batch_the_aot_plan_compiles(world, tmp_path, algo, extra):
  """One definition of the update's inputs: what the trainer's jitted step receives matches
  `UpdateBatch.abstract` in fields, shapes, dtypes and shardings, and so does the AOT plan's batch
  (whose length is a full context, the most a step can have)."""
  import dataclasses
  from rlver_jax.aot import programs as ap
  from rlver_jax.rl.batch import UpdateBatch
  trainer, dialogues, batch, _, _ = _rollout_and_batch(world, tmp_path, algo, **extra)
  config = trainer.spec   # the plan reads the run's spec, as the trainer does
  mini = trainer.policy_up.weighted(batch.mini_batch(0))
  rl = trainer.spec.rl
  want = UpdateBatch.abstract(mini.tokens.shape, trainer.mesh, values=algo == "ppo",
                              ref_logp=rl.kl_coef > 0 and not rl.kl_in_reward)
  planned = ap.abstract_batch(config, trainer.mesh)
  assert list(mini.arrays()) == list(want.arrays()) == list(planned.arrays())
  assert (mini.ref_logp is not None) == (algo == "grpo") and (mini.returns is not None) == (algo == "ppo")
  # Every dialogue makes one sample here: the step has the most samples the plan allows.
  assert sum(len(d.samples) for d in dialogues) == ap.num_samples(config)
  M, B, T = mini.tokens.shape
  if rl.pack_update:
    assert M * B <= planned.tokens.shape[0] * planned.tokens.shape[1]
  else:
    assert planned.tokens.shape[:2] == (M, B)
  assert T <= planned.tokens.shape[2]
  assert batch.mini_batches == ap.mini_batches(config)
  for name, got in mini.arrays().items():
    spec, plan = getattr(want, name), getattr(planned, name)
    assert (got.shape, got.dtype) == (spec.shape, spec.dtype), name
    assert got.dtype == plan.dtype and spec.sharding == plan.sharding, name
    if name == "weights":  # computed eagerly by `Updater.weighted`, they come out replicated
      continue
    assert got.sharding.is_equivalent_to(spec.sharding, got.ndim), name  # old_logp: jit's spelling
  assert dataclasses.replace(mini, mini_batches=1) == mini  # a mini-batch is one mini-batch
  trainer.checkpointer.close()
