"""Mini-batches counted in rows, like the reference: in think mode each policy turn is a row, so a
step with T-turn dialogues makes T optimizer updates; the warm-up schedule advances per update."""
import dataclasses

import jax
import numpy as np
import pytest

import tiny_world
from rlver_jax.train import loop as train
from rlver_jax.parallel.sharding import host_array
from rlver_jax.rl import batch as batch_module
from rlver_jax.rl.batch import BatchLayout, UpdateBatch, mini_batch_count, packed_rows


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


def test_micro_batches_hold_no_more_rows_than_a_mini_batch_needs():
  # ppo_think on v5p-64: 32 dialogues x 9 turns, mini-batches of 32 rows, 4 rows per device on 32
  # devices. Unfitted, each 32-row mini-batch sat in a 128-row micro-batch (1,152 rows for 288).
  layout = BatchLayout.for_step(288, 8192, 4 * 32, mini_batch_rows=32, mini_batches=1, shards=32)
  assert (layout.micro_rows, layout.rows, layout.mini_batches) == (32, 288, 9)
  assert layout.update_shape == (1, 32, 8192)
  # On 16 devices the same mini-batch is 2 rows a device; on 8 it fills 4 a device, as configured.
  assert BatchLayout.for_step(288, 8192, 4 * 16, mini_batch_rows=32, mini_batches=1,
                              shards=16).micro_rows == 32
  assert BatchLayout.for_step(288, 8192, 4 * 8, mini_batch_rows=32, mini_batches=1,
                              shards=8).micro_rows == 32
  # Larger mini-batches keep several micro-batches of the configured size (grpo_think: 128 rows).
  assert BatchLayout.for_step(1152, 8192, 4 * 32, mini_batch_rows=128, mini_batches=1,
                              shards=32).update_shape == (1, 128, 8192)
  # One mini-batch of 10 samples on 8 shards: 16 rows (a bucketed multiple of 8), not 32.
  assert BatchLayout.for_step(10, 64, 4 * 8, mini_batch_rows=0, mini_batches=1, shards=8).rows == 16
  # A fixed count of several mini-batches fills micro-batches in order: its layout is kept.
  assert BatchLayout.for_step(10, 64, 4 * 8, mini_batch_rows=0, mini_batches=2,
                              shards=8).micro_rows == 32


def test_a_fitted_micro_batch_trains_like_a_padded_one(world, tmp_path, monkeypatch):
  """The padding rows the fitted layout drops carry no loss: the update is the same."""
  config = tiny_world.training_config(world, "grpo", total_steps=1, **{
      "rl.micro_batch_size": 4, "rl.pack_update": False})  # one sample a row: the rows counted below
  trainer = tiny_world.trainer(config, str(tmp_path))
  updated, shapes = {}, {}
  with jax.set_mesh(trainer.mesh):
    dialogues, _ = trainer.rollout(jax.random.key(3))
    start = jax.tree.map(lambda x: x.copy(), trainer.state)
    for kind in ("fitted", "padded"):
      if kind == "padded":
        monkeypatch.setattr(batch_module, "fitted_micro_rows", lambda micro_rows, *args: micro_rows)
      trainer.state = jax.tree.map(lambda x: x.copy(), start)
      batch, _ = trainer.make_batch(dialogues)
      shapes[kind] = batch.tokens.shape[:2]
      metrics = trainer.update(batch)
      updated[kind] = ([np.asarray(x) for x in jax.tree.leaves(trainer.state.policy)], metrics)
  # 2 profiles x 8 = 16 rows, one mini-batch; 4 rows a device on 8 devices would be 32.
  assert shapes == {"fitted": (1, 16), "padded": (1, 32)}
  (fitted, m_fitted), (padded, m_padded) = updated["fitted"], updated["padded"]
  assert np.isfinite(m_fitted["loss"]) and m_fitted["grad_norm"] > 0
  np.testing.assert_allclose(m_fitted["loss"], m_padded["loss"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(m_fitted["grad_norm"], m_padded["grad_norm"], rtol=1e-5)
  # Adam's first step is ~lr (3e-2) a parameter whatever the gradient's scale (which the loss and
  # grad norm above pin down); float-summation differences move a near-zero gradient's step by up
  # to ~2e-5, under 0.1% of a step.
  for a, b in zip(fitted, padded):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  assert any(not np.allclose(a, np.asarray(s)) for a, s in zip(fitted, jax.tree.leaves(start.policy)))
  trainer.checkpointer.close()


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
    # Mini-batch m holds samples 4m..4m+3 (segment ids k + 1, packed or one a row), each with its
    # own tokens and its dialogue's advantage.
    samples = [(i, s) for i, d in enumerate(dialogues) for s in d.samples]
    arrays = [host_array(x) for x in (batch.tokens, batch.advantages, batch.segment_ids)]
    rewards = np.array([d.reward for d in dialogues])
    for m in range(3):
      part_tokens, part_adv, part_seg = (x[m::3].reshape(-1, x.shape[-1]) for x in arrays)
      assert sorted(set(part_seg[part_seg > 0])) == [4 * m + j + 1 for j in range(4)]
      for k in range(4 * m, 4 * m + 4):
        (i, s), (r, t) = samples[k], np.argwhere(part_seg == k + 1)[0]
        span = slice(t, t + len(s.tokens))
        np.testing.assert_array_equal(part_tokens[r, span], s.tokens)
        group = rewards[2 * (i // 2):2 * (i // 2) + 2]
        want = (rewards[i] - group.mean()) / (group.std(ddof=1) + 1e-6)
        np.testing.assert_allclose(part_adv[r, span], want * np.array(s.loss_mask),
                                   rtol=1e-5, atol=1e-6)
    metrics = trainer.update(batch)
  assert metrics["optimizer_updates"] == 3
  # The warm-up schedule is indexed by this count: 3 of its 8 updates are done after one RL step.
  assert _update_counts(trainer.state.policy_opt) == {3}
  # Count-based instead: the same rollout makes rl.mini_batches = 1 update.
  spec = trainer.spec
  trainer.spec = dataclasses.replace(spec, rl=dataclasses.replace(spec.rl, mini_batch_rows=0))
  with jax.set_mesh(trainer.mesh):
    batch, _ = trainer.make_batch(dialogues)
    assert trainer.update(batch)["optimizer_updates"] == 1
  assert _update_counts(trainer.state.policy_opt) == {4}
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
