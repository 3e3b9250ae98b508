"""Mini-batches counted in rows, like the reference: in think mode each policy turn is a row, so a
step with T-turn dialogues makes T optimizer updates; the warm-up schedule advances per update."""
import dataclasses

import jax
import numpy as np
import pytest

import tiny_world
from rlver_jax.train import loop as train
from rlver_jax.parallel.sharding import host_array
from rlver_jax.rl.batch import UpdateBatch, mini_batch_count, packed_rows


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


def _update_counts(opt_state):
  leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
  return {int(v) for path, v in leaves if "count" in jax.tree_util.keystr(path)}


def test_mini_batch_arithmetic():
  assert mini_batch_count(12, 4, 1) == 3 and mini_batch_count(13, 4, 1) == 4
  assert mini_batch_count(3, 4, 1) == 1 and mini_batch_count(0, 4, 1) == 1
  assert mini_batch_count(50, 0, 2) == 2  # count-based
  # Every mini-batch but the last holds R = 4 rows: 3 x 8-row micro-batches give room for 3 x 4.
  assert packed_rows(9, 8, 3, 4) == 24 and packed_rows(9, 1, 3, 4) == 12


def test_a_think_step_with_t_turns_makes_t_updates(world, tmp_path):
  # 2 profiles x 2 samples, 3 turns each (scripted scores keep 30 within (0, 100) for 3 turns, and
  # state F is not reached before the third): 12 rows, mini-batches of 4 rows -> 3 updates.
  config = tiny_world.training_config(world, "grpo", **{
      "total_steps": 1, "policy.think": True, "simulator.max_turns": 3, "rl.profiles_per_step": 2,
      "rl.group_size": 2, "optim.warmup_steps": 8})
  trainer = tiny_world.trainer(config, str(tmp_path))
  with jax.set_mesh(trainer.mesh):
    dialogues, _ = trainer.rollout(jax.random.key(3))
    assert [len(d.samples) for d in dialogues] == [3, 3, 3, 3]
    batch, extra = trainer.make_batch(dialogues)
    assert batch.mini_batches == 3
    # Mini-batch m holds samples 4m..4m+3, each with its own tokens and its dialogue's advantage.
    samples = [(i, s) for i, d in enumerate(dialogues) for s in d.samples]
    tokens, adv = host_array(batch.tokens), host_array(batch.advantages)
    rewards = np.array([d.reward for d in dialogues])
    for m in range(3):
      part_tokens = tokens[m::3].reshape(-1, tokens.shape[-1])
      part_adv = adv[m::3].reshape(-1, adv.shape[-1])
      real = [r for r in range(part_tokens.shape[0]) if (part_tokens[r] != trainer.chat.pad_id).any()]
      assert len(real) == 4
      for r, (i, s) in zip(real, samples[4 * m:4 * m + 4]):
        np.testing.assert_array_equal(part_tokens[r, :len(s.tokens)], s.tokens)
        group = rewards[2 * (i // 2):2 * (i // 2) + 2]
        want = (rewards[i] - group.mean()) / (group.std(ddof=1) + 1e-6)
        np.testing.assert_allclose(part_adv[r, :len(s.tokens)], want * np.array(s.loss_mask),
                                   rtol=1e-5, atol=1e-6)
    metrics = trainer.update(batch)
  assert metrics["optimizer_updates"] == 3
  # The warm-up schedule is indexed by this count: 3 of its 8 updates are done after one RL step.
  assert _update_counts(trainer.state["policy_opt"]) == {3}
  # Count-based instead: the same rollout makes rl.mini_batches = 1 update.
  spec = trainer.spec
  trainer.spec = dataclasses.replace(spec, rl=dataclasses.replace(spec.rl, mini_batch_rows=0))
  with jax.set_mesh(trainer.mesh):
    batch, _ = trainer.make_batch(dialogues)
    assert trainer.update(batch)["optimizer_updates"] == 1
  assert _update_counts(trainer.state["policy_opt"]) == {4}
  trainer.checkpointer.close()


def test_warmup_in_rl_steps_scales_each_steps_updates():
  import dataclasses
  from types import SimpleNamespace
  from rlver_jax.spec import OptimSpec
  from rlver_jax.train.trainer import Trainer
  optim = OptimSpec(warmup_unit="steps", warmup_steps=20, critic_warmup_steps=50)
  scale = lambda step, critic=False: Trainer._step_warmup(
      SimpleNamespace(spec=SimpleNamespace(optim=optim), step=step), critic)
  assert [scale(s) for s in (0, 5, 20, 30)] == [0.0, 0.25, 1.0, 1.0]
  assert [scale(s, critic=True) for s in (0, 25, 50)] == [0.0, 0.5, 1.0]
  steps = optim
  optim = dataclasses.replace(optim, warmup_unit="updates")
  assert scale(3) is None  # the optimizer's own schedule counts updates
  steps = dataclasses.replace(steps, actor_lr=1e-3, critic_lr=1e-3, b1=0.9, b2=0.999,
                              weight_decay=0.01, grad_clip=1.0)
  assert steps.optim_config().warmup_steps == 0  # constant: the trainer scales instead


def test_lr_scale_scales_the_update():
  import jax.numpy as jnp
  from flax import nnx
  from rlver_jax.models.factory import create_model
  from rlver_jax.models.presets import Qwen2Config
  from rlver_jax.rl.update import LossConfig, OptimConfig, Updater, make_optimizer
  cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, tie_word_embeddings=True, qkv_bias=False)
  model = create_model(cfg, dtype=jnp.float32, seed=0, init_std=0.5)
  up = Updater(model, make_optimizer(OptimConfig(learning_rate=1e-2, weight_decay=0.01)), "policy",
               LossConfig(logits_chunk=8))
  tokens = jnp.arange(8, dtype=jnp.int32)[None, None] + 3
  mask = jnp.asarray([[[0, 0, 0, 1, 1, 1, 1, 1]]], jnp.float32)
  batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens), "loss_mask": mask,
           "old_logp": jnp.zeros_like(mask) - 4.0, "advantages": mask}
  start = nnx.state(model, nnx.Param)
  moved = {}
  for s in (None, 1.0, 0.5, 0.0):
    params = jax.tree.map(jnp.copy, start)
    new, _, _ = up.step(params, up.init(params), UpdateBatch(**batch), lr_scale=s)
    moved[s] = jax.tree.map(lambda a, b: np.asarray(a - b), new, start)
  flat = {s: np.concatenate([x.ravel() for x in jax.tree.leaves(v)]) for s, v in moved.items()}
  assert np.abs(flat[1.0]).max() > 1e-4
  np.testing.assert_allclose(flat[None], flat[1.0], rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(flat[0.5], 0.5 * flat[1.0], rtol=1e-4, atol=1e-8)
  assert not flat[0.0].any()
