"""The update's arithmetic under `:reference` (issue: the reference's loss averaging and critic
tokens): hand-computed weights, and one mini-batch's policy and critic losses through `Updater`
against a NumPy transcription of the reference's rules (32 GPUs each taking a token mean over its
consecutive share of the rows; the critic trained on the shifted attention mask, its targets from a
GAE that walks every response position)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlver_jax import build
from rlver_jax.models import create_model, export_pretrained
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.rl import losses
from rlver_jax.rl.batch import UpdateBatch
from rlver_jax.rl.prepare import critic_targets, reference_value_mask
from rlver_jax.rl.update import LossConfig, Updater, token_logprobs_and_entropy, token_values
from rlver_jax.spec.sections import CriticSpec, PolicySpec

CFG = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def test_chunk_token_mean_weights_by_hand():
  # Rows with 2, 0 (padding), 1 and 3 policy tokens; 2 runs over the 3 rows that hold tokens:
  # rows 0 and 2 (3 tokens), then row 3 (3 tokens). Each token weighs 1 / 3 / 2.
  mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 1]], np.float32)
  w = np.asarray(losses.token_weights(jnp.asarray(mask), "chunk-token-mean", chunks=2))
  np.testing.assert_allclose(w, mask / 6.0, rtol=1e-7)
  # 3 runs over those rows: a row each, so a sequence mean: row 2's one token weighs 1/3.
  w3 = np.asarray(losses.token_weights(jnp.asarray(mask), "chunk-token-mean", chunks=3))
  np.testing.assert_allclose(w3, mask * np.array([[1 / 6], [0], [1 / 3], [1 / 9]]), rtol=1e-7)
  # One run is a token mean: every token 1/6.
  w1 = np.asarray(losses.token_weights(jnp.asarray(mask), "chunk-token-mean", chunks=1))
  np.testing.assert_allclose(w1, mask / 6.0, rtol=1e-7)
  assert not np.allclose(w3, w1)


def test_a_row_a_chunk_is_seq_mean_token_mean_exactly():
  # PPO under :reference: 32 rows a mini-batch on 32 GPUs.
  rng = np.random.RandomState(0)
  mask = (rng.rand(32, 40) < 0.3).astype(np.float32)
  mask[5] = 0  # a row without policy tokens counts in neither mean
  chunked = losses.token_weights(jnp.asarray(mask), "chunk-token-mean", chunks=32)
  seq = losses.token_weights(jnp.asarray(mask), "seq-mean-token-mean")
  np.testing.assert_array_equal(np.asarray(chunked), np.asarray(seq))
  token = losses.token_weights(jnp.asarray(mask), "token-mean")
  assert not np.allclose(np.asarray(chunked), np.asarray(token))


def test_reference_value_mask_by_hand():
  # No-think row: prompt 0-2, policy 3-4, a user token 5, policy 6; 7 real tokens in 9 slots.
  loss = np.array([[0, 0, 0, 1, 1, 0, 1, 0, 0]], np.float32)
  seg = np.array([[1, 1, 1, 1, 1, 1, 1, 0, 0]], np.int32)
  # From the first policy token through the slot after the last token (the shifted mask).
  np.testing.assert_array_equal(reference_value_mask(loss, seg), [[0, 0, 0, 1, 1, 1, 1, 1, 0]])
  full = np.ones((1, 7), np.int32)  # a row without room after its end gets no extra slot
  np.testing.assert_array_equal(reference_value_mask(loss[:, :7], full), [[0, 0, 0, 1, 1, 1, 1]])


def _verl_gae(rewards, values, response_start, past_end, gamma, lam):
  """The reference's GAE on one row: every response position from `response_start` walked, values
  zero from `past_end + 1` on (its values times the shifted mask), returns = advantages + values."""
  T = len(rewards)
  v = np.where(np.arange(T) <= past_end, values, 0.0)
  adv = np.zeros(T)
  last = 0.0
  for t in reversed(range(response_start, T)):
    nxt = v[t + 1] if t + 1 < T else 0.0
    last = rewards[t] + gamma * nxt - v[t] + gamma * lam * last
    adv[t] = last
  return adv, adv + v


def test_critic_targets_walk_the_reference_positions():
  rng = np.random.RandomState(1)
  loss = np.array([[0, 0, 1, 1, 0, 0, 1, 0, 0, 0],
                   [0, 1, 1, 1, 1, 0, 0, 0, 0, 0]], np.float32)
  seg = np.array([[1] * 7 + [0] * 3, [1] * 5 + [0] * 5], np.int32)
  rewards = np.zeros_like(loss)
  rewards[0, 6], rewards[1, 4] = 0.7, 0.3  # terminal rewards on each row's last policy token
  values = rng.randn(*loss.shape).astype(np.float32)
  vm = reference_value_mask(loss, seg)
  for gamma, lam in ((1.0, 1.0), (0.9, 0.8)):
    t = critic_targets(rewards, values, loss, gamma=gamma, lam=lam, whiten=False, value_mask=vm)
    for i, (start, end) in enumerate(((2, 7), (1, 5))):
      adv, ret = _verl_gae(rewards[i], values[i], start, end, gamma, lam)
      np.testing.assert_allclose(t.advantages[i], adv * loss[i], rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(t.returns[i], ret * vm[i], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(t.value_mask, vm)
  # gamma = lambda = 1: the return is the reward on every trained slot but the one past the end.
  t = critic_targets(rewards, values, loss, gamma=1.0, lam=1.0, whiten=False, value_mask=vm)
  np.testing.assert_allclose(t.returns[0, 2:8], [0.7] * 5 + [0.0], atol=1e-6)
  plain = critic_targets(rewards, values, loss, gamma=1.0, lam=1.0, whiten=False)
  assert plain.returns[0, 4] == 0.0 and plain.value_mask[0, 7] == 0.0  # policy tokens only


def _mini_batch(rng, rows=8, T=14):
  tokens = rng.randint(1, 50, size=(rows, T))
  seg = np.zeros((rows, T), np.int32)
  loss = np.zeros((rows, T), np.float32)
  for r in range(rows):
    real = T - 1 - r % 4  # every row has room after its end
    seg[r, :real] = 1
    tokens[r, real:] = 0
    start = 2 + r % 3
    loss[r, start:real] = 1.0
    loss[r, start + 2] = 0.0  # a simulated-user token inside the response (no-think)
  return tokens, seg, loss


def _reference_chunk_mean(per_token, mask, chunks):
  """The reference's reduction: consecutive row shares, a token mean in each, their mean."""
  parts = [(p * m).sum() / m.sum() for p, m in zip(np.split(per_token, chunks),
                                                     np.split(mask, chunks))]
  return float(np.mean(parts))


@pytest.mark.parametrize("chunks", [4, 8])
def test_update_losses_equal_the_reference_arithmetic(chunks):
  rng = np.random.RandomState(2)
  tokens, seg, loss = _mini_batch(rng)
  policy = create_model(CFG, dtype=jnp.float32, seed=1)
  critic = create_model(CFG, head="value", dtype=jnp.float32, seed=2)
  build.init_value_head(critic, jax.random.key(3), 0.3)
  old_logp = rng.randn(*loss.shape).astype(np.float32) * 0.1 - 3.0
  adv = rng.randn(*loss.shape).astype(np.float32)
  old_values = rng.randn(*loss.shape).astype(np.float32) * 0.1
  returns = rng.randn(*loss.shape).astype(np.float32)
  vm = reference_value_mask(loss, seg)
  arrays = dict(tokens=tokens, segment_ids=seg, loss_mask=loss, old_logp=old_logp, advantages=adv,
                old_values=old_values, returns=returns, value_mask=vm)
  # Two micro-batches of 4 rows: rows keep their order in the mini-batch's [M, B] view.
  batch = UpdateBatch(**{k: jnp.asarray(v).reshape(2, 4, -1) for k, v in arrays.items()})
  cfg = LossConfig(agg="chunk-token-mean", chunks=chunks, entropy_coef=0.0, value_clip=0.5)

  up = Updater(policy, optax.sgd(0.0), "policy", cfg)
  params = jax.tree.map(jnp.copy, nnx.state(policy, nnx.Param))  # the step donates its input
  _, _, metrics = up.step(params, up.init(params), batch)
  logp, _ = token_logprobs_and_entropy(policy, jnp.asarray(tokens), jnp.asarray(seg), 8)
  ratio = np.exp(np.asarray(logp) - old_logp)
  pg = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
  expected = _reference_chunk_mean(pg, loss, chunks)
  np.testing.assert_allclose(float(metrics["pg_loss"]), expected, rtol=2e-5)
  token_mean = float((pg * loss).sum() / loss.sum())
  assert abs(expected - token_mean) > 1e-3  # the two averagings differ on this batch

  up = Updater(critic, optax.sgd(0.0), "value", cfg)
  params = jax.tree.map(jnp.copy, nnx.state(critic, nnx.Param))
  _, _, metrics = up.step(params, up.init(params), batch)
  v = np.asarray(token_values(critic, jnp.asarray(tokens), jnp.asarray(seg)))
  clipped = np.clip(v, old_values - 0.5, old_values + 0.5)
  vf = 0.5 * np.maximum((v - returns) ** 2, (clipped - returns) ** 2)
  np.testing.assert_allclose(float(metrics["vf_loss"]), _reference_chunk_mean(vf, vm, chunks),
                             rtol=2e-5)
  assert abs(_reference_chunk_mean(vf, vm, chunks) - _reference_chunk_mean(vf, loss, chunks)) > 1e-4


def test_normal_value_head_from_the_checkpoints_initializer_range(tmp_path):
  cfg = Qwen2Config(**{**CFG.__dict__, "initializer_range": 0.05, "checkpoint_dtype": "float32"})
  export_pretrained(create_model(cfg, dtype=jnp.float32, seed=0), cfg, str(tmp_path / "ckpt"))
  policy = PolicySpec(checkpoint=str(tmp_path / "ckpt"), compute_dtype="float32", remat="none")
  zeros = build.load_critic(CriticSpec(), policy, None, str(tmp_path / "ckpt"), seed=4)
  assert not np.asarray(zeros.value_head[...]).any()
  normal = build.load_critic(CriticSpec(head_init="normal"), policy, None, str(tmp_path / "ckpt"),
                             seed=4)
  expected = 0.05 * jax.random.normal(jax.random.key(4), (CFG.hidden_size,), jnp.float32)
  np.testing.assert_allclose(np.asarray(normal.value_head[...]), np.asarray(expected), rtol=1e-6)
  assert float(normal.value_bias[...]) == 0.0
  with pytest.raises(ValueError, match="critic.head_init"):
    CriticSpec(head_init="uniform")
