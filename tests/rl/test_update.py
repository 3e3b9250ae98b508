"""The fused update: micro-batch accumulation == one big batch; padding never changes gradients;
the chunked log-probs equal the plain ones."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlver_jax.models.factory import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.rl import losses
from rlver_jax.rl.batch import UpdateBatch
from rlver_jax.rl.update import LossConfig, Updater, token_logprobs_and_entropy, token_values

CFG = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def _batch(rng, B=4, T=12):
  tokens = rng.randint(1, 50, size=(B, T))
  seg = np.ones((B, T), np.int32)
  mask = np.zeros((B, T), np.float32)
  for b in range(B):
    real = T - b  # row b has b padding tokens at the end
    seg[b, real:] = 0
    tokens[b, real:] = 0
    mask[b, 4:real] = 1.0
  return dict(tokens=tokens, segment_ids=seg, loss_mask=mask,
              old_logp=rng.randn(B, T).astype(np.float32) * 0.1 - 3.0,
              advantages=rng.randn(B, T).astype(np.float32),
              old_values=rng.randn(B, T).astype(np.float32) * 0.1,
              returns=rng.randn(B, T).astype(np.float32))


def _split(batch, m):
  return UpdateBatch(**{k: jnp.asarray(v).reshape(m, v.shape[0] // m, *v.shape[1:])
                        for k, v in batch.items()})


@pytest.mark.parametrize("head,loss,agg", [("lm", "policy", "token-mean"),
                                           ("lm", "policy", "seq-mean-token-mean"),
                                           ("value", "value", "token-mean")])
def test_microbatches_equal_one_batch(head, loss, agg):
  model = create_model(CFG, head=head, dtype=jnp.float32, seed=1)
  if head == "value":  # a zero value head has no gradient signal into the trunk
    model.value_head[...] = jax.random.normal(jax.random.key(0), (CFG.hidden_size,)) * 0.1
  batch = _batch(np.random.RandomState(0))
  # SGD: the update is -lr * grad, so equal params after one step means equal gradients.
  outs = []
  for m in (1, 2, 4):
    up = Updater(model, optax.sgd(1.0), loss, LossConfig(agg=agg, entropy_coef=0.01))
    params = nnx.state(model, nnx.Param)
    params = jax.tree.map(jnp.copy, params)
    new, _, metrics = up.step(params, up.init(params), _split(batch, m))
    outs.append((new, metrics))
  for new, metrics in outs[1:]:
    for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(new)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
    np.testing.assert_allclose(metrics["loss"], outs[0][1]["loss"], rtol=1e-5, atol=1e-7)


def test_padding_rows_do_not_change_gradients():
  model = create_model(CFG, dtype=jnp.float32, seed=2)
  batch = _batch(np.random.RandomState(1), B=2)
  padded = {k: np.concatenate([v, np.zeros_like(v)], axis=0) for k, v in batch.items()}
  padded["tokens"][2:] = 7  # junk tokens in padding rows, mask 0 everywhere
  results = []
  for b in (batch, padded):
    up = Updater(model, optax.sgd(1.0), "policy", LossConfig())
    params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    new, _, _ = up.step(params, up.init(params), _split(b, 1))
    results.append(new)
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_chunked_logprobs_equal_full_logits():
  model = create_model(CFG, dtype=jnp.float32, seed=3)
  batch = _batch(np.random.RandomState(2))
  tokens, seg = jnp.asarray(batch["tokens"]), jnp.asarray(batch["segment_ids"])
  logp, ent = token_logprobs_and_entropy(model, tokens, seg, chunk=5)
  logits = model(tokens, segment_ids=seg)
  want = losses.token_logprobs(logits[:, :-1], tokens[:, 1:])
  np.testing.assert_allclose(np.asarray(logp[:, 1:]), np.asarray(want), atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent[:, 1:]),
                             np.asarray(losses.entropy_from_logits(logits[:, :-1])), atol=1e-5)
  assert float(jnp.abs(logp[:, 0]).max()) == 0.0


def test_token_values_align_with_states():
  critic = create_model(CFG, head="value", dtype=jnp.float32)
  critic.value_head[...] = jnp.linspace(-1, 1, CFG.hidden_size)
  critic.value_bias[...] = jnp.float32(0.5)
  tokens = jnp.asarray([[3, 4, 5, 6]])
  vals = token_values(critic, tokens, jnp.ones_like(tokens))
  direct = critic(tokens)  # value of the state ending at each token
  np.testing.assert_allclose(np.asarray(vals[0, 1:]), np.asarray(direct[0, :-1]), atol=1e-6)


def test_metrics_weight_micro_batches_by_their_tokens():
  # Micro-batches with few or no policy tokens (padding rows) must not pull the per-token metrics
  # towards their own values: 4 uneven micro-batches, the last all padding, equal one batch.
  model = create_model(CFG, dtype=jnp.float32, seed=1)
  rng = np.random.RandomState(0)
  batch = _batch(rng, B=8)
  batch["old_logp"] = batch["old_logp"] + 3.0 - rng.rand(8, 12).astype(np.float32)  # ratios != 1
  for k in ("segment_ids", "loss_mask"):
    batch[k][6:] = 0  # rows 6 and 7 are padding
  batch["loss_mask"][5, 5:] = 0  # row 5 keeps one policy token
  outs = []
  for m in (1, 4):
    up = Updater(model, optax.sgd(0.0), "policy", LossConfig(clip_low=0.2, clip_high=0.2))
    params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    outs.append(up.step(params, up.init(params), _split(batch, m))[2])
  one, many = outs
  for k in ("ratio_mean", "clip_frac", "approx_kl", "ratio_max", "ratio_min", "loss"):
    np.testing.assert_allclose(float(many[k]), float(one[k]), rtol=1e-5, err_msg=k)
  assert float(one["clip_frac"]) > 0  # the ratios are far enough from 1 to clip


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_policy_loss_equals_a_hand_computed_total():
  """PPO clipped surrogate - entropy_coef * entropy + kl_coef * k3 KL, token-mean, from the model's
  full logits in numpy: catches a wrong sign or term anywhere in the total."""
  model = create_model(CFG, dtype=jnp.float32, seed=4)
  rng = np.random.RandomState(3)
  batch = _batch(rng)
  batch["ref_logp"] = batch["old_logp"] + rng.randn(*batch["old_logp"].shape).astype(np.float32) * 0.3
  cfg = LossConfig(clip_low=0.2, clip_high=0.3, entropy_coef=0.05, kl_coef=0.4, kl_kind="k3")
  up = Updater(model, optax.sgd(0.0), "policy", cfg)
  params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  _, _, metrics = up.step(params, up.init(params), _split(batch, 2))

  logits = np.asarray(model(jnp.asarray(batch["tokens"]), segment_ids=jnp.asarray(batch["segment_ids"])),
                      np.float64)
  logq = _log_softmax(logits[:, :-1])  # position t-1 predicts token t
  tok = batch["tokens"][:, 1:]
  logp = np.take_along_axis(logq, tok[..., None], -1)[..., 0]
  ent = -(np.exp(logq) * logq).sum(-1)
  m = batch["loss_mask"][:, 1:].astype(np.float64)
  adv, old, ref = (batch[k][:, 1:].astype(np.float64) for k in ("advantages", "old_logp", "ref_logp"))
  ratio = np.exp(logp - old)
  pg = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - 0.2, 1 + 0.3))
  d = ref - logp
  kl = np.exp(d) - d - 1
  mean = lambda x: (x * m).sum() / m.sum()
  assert batch["loss_mask"][:, 0].sum() == 0  # position 0 has no prediction: never trained
  want = mean(pg) - 0.05 * mean(ent) + 0.4 * mean(kl)
  np.testing.assert_allclose(float(metrics["loss"]), want, rtol=2e-5)
  np.testing.assert_allclose(float(metrics["entropy"]), mean(ent), rtol=2e-5)
  np.testing.assert_allclose(float(metrics["kl_loss"]), mean(kl), rtol=2e-5)


@pytest.mark.parametrize("grad_clip", [0.0, 1.0])
def test_optimizer_clips_by_global_norm_then_adamw(grad_clip):
  """Against plain optax.adamw on hand-clipped gradients: a norm-5 then a norm-0.5 gradient (Adam's
  first step ignores the gradient's scale, its second does not)."""
  from rlver_jax.rl.update import OptimConfig, make_optimizer
  cfg = OptimConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.01, grad_clip=grad_clip)
  ours, plain = make_optimizer(cfg), optax.adamw(0.1, weight_decay=0.01)
  p = q = jnp.array([1.0, -2.0])
  s, t = ours.init(p), plain.init(q)
  for g in (jnp.array([3.0, 4.0]), jnp.array([0.3, -0.4])):
    norm = float(jnp.linalg.norm(g))
    g_clipped = g * min(1.0, grad_clip / norm) if grad_clip else g
    u, s = ours.update(g, s, p)
    v, t = plain.update(g_clipped, t, q)
    p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
  np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=1e-6)
  unclipped = optax.adamw(0.1, weight_decay=0.01)
  r, w = jnp.array([1.0, -2.0]), None
  w = unclipped.init(r)
  for g in (jnp.array([3.0, 4.0]), jnp.array([0.3, -0.4])):
    u, w = unclipped.update(g, w, r)
    r = optax.apply_updates(r, u)
  assert np.allclose(np.asarray(p), np.asarray(r)) == (grad_clip == 0.0)  # clipping did something


def test_optimizer_refuses_a_negative_clip():
  from rlver_jax.rl.update import OptimConfig, make_optimizer
  with pytest.raises(ValueError, match="grad_clip=-1"):
    make_optimizer(OptimConfig(grad_clip=-1.0))


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_the_gradients(remat):
  """Rematerialisation trades memory for recompute only: the policy gradient equals the plain one,
  and the traced step really holds a checkpointed block (a no-op remat would pass the first check)."""
  batch = {k: jnp.asarray(v) for k, v in _batch(np.random.RandomState(5)).items()}

  def grads_of(policy):
    model = create_model(CFG, dtype=jnp.float32, seed=6, remat=policy)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
      m = nnx.merge(graphdef, p, rest)
      logp, _ = token_logprobs_and_entropy(m, batch["tokens"], batch["segment_ids"], chunk=8)
      return (logp * batch["loss_mask"]).sum()

    return jax.grad(loss)(params), str(jax.make_jaxpr(jax.grad(loss))(params))

  plain, plain_jaxpr = grads_of("none")
  ours, jaxpr = grads_of(remat)
  # The LM-head chunks are checkpointed in every mode; the blocks only under remat.
  assert jaxpr.count("remat") > plain_jaxpr.count("remat")
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(ours)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
