"""Packed == unpacked: several samples in one row of the update (rl.pack_update) give the same
log-probs, values, advantages, returns, losses and gradients as one sample a row, for every loss
aggregation mode, GRPO and PPO (both critic masks), and mini-batches counted in rows."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlver_jax.models.factory import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.rl.algorithms import GRPO, PPO
from rlver_jax.rl.batch import UpdateBatch
from rlver_jax.rl import samples
from rlver_jax.rl.pack import pack_step, step_places
from rlver_jax.rl.prepare import reference_value_mask
from rlver_jax.rl.rollout_correction import mismatch_metrics
from rlver_jax.rl.update import LossConfig, Updater, token_logprobs_and_entropy, token_values

CFG = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
SGD = optax.sgd(1.0)  # the update is -grad: equal params after a step mean equal gradients


def _dialogues(rng, n=7):
  """Dialogues of one or two samples of 9..40 tokens: a prompt, then policy and user turns; one
  sample without policy tokens (it must count in no mean, wherever it lands)."""
  out = []
  for i in range(n):
    samples = []
    for _ in range(1 + i % 2):
      L = int(rng.randint(9, 41))
      mask = np.zeros(L, np.float32)
      t = 3
      while t < L:
        span = int(rng.randint(2, 8))
        mask[t:t + span] = 1.0
        t += span + int(rng.randint(1, 6))
      if len(out) == 2 and not samples:
        mask[:] = 0.0
      last = int(np.flatnonzero(mask)[-1]) if mask.any() else L - 1
      samples.append(SimpleNamespace(tokens=rng.randint(1, 50, size=L).tolist(), loss_mask=mask,
                                     sampler_logp=(rng.randn(L) * 0.1 - 3.0).astype(np.float32),
                                     token_rewards={last: float(rng.randn())}))
    out.append(SimpleNamespace(samples=samples, reward=float(rng.rand()), group_id=i // 2))
  return out


def _per_sample(p, x, T):
  """[N, T] -> each sample's tokens and the slot past them where a row of `T` has room, in order."""
  lens = [int((p.segment_ids == k + 1).sum()) for k in range(p.num_real)]
  return [np.asarray(x)[r, a:a + L + (L < T)] for (r, a), L in zip(p.at, lens)]


def _layouts(dialogues, mini_batch_rows):
  kw = dict(mini_batch_rows=mini_batch_rows, mini_batches=1, shards=1)
  return (pack_step(dialogues, 4, 0, **kw),
          pack_step(dialogues, 4, 0, pack_length=0, **kw),
          pack_step(dialogues, 4, 0, pack_length=256, **kw))


def _grads(model, loss, cfg, batch):
  """Per mini-batch: (loss, -grad) from one SGD step from the same params."""
  up = Updater(model, SGD, loss, cfg)
  params = nnx.state(model, nnx.Param)
  out = []
  for part in range(batch.mini_batches):
    start = jax.tree.map(jnp.copy, params)
    new, _, metrics = up.step(start, up.init(start), batch.mini_batch(part))
    out.append((float(metrics["loss"]), jax.tree.map(lambda a, b: np.asarray(a - b), params, new)))
  return out


def _run(p, algo, dialogues, policy, critic, cfg):
  shape = p.layout.step_shape
  tokens, seg = jnp.asarray(p.tokens), jnp.asarray(p.segment_ids)
  old_logp = np.asarray(token_logprobs_and_entropy(policy, tokens, seg, 16)[0])
  values = None if critic is None else np.asarray(token_values(critic, tokens, seg))
  target = algo.targets(dialogues, p, p.rewards, values)
  dev = lambda x: None if x is None else jnp.asarray(x).reshape(shape)
  batch = UpdateBatch(tokens=dev(p.tokens), segment_ids=dev(p.segment_ids),
                      loss_mask=dev(p.loss_mask),
                      old_logp=dev(old_logp - 0.05 * p.loss_mask * np.cos(p.tokens)),  # ratios != 1
                      advantages=dev(target.advantages), rollout_logp=dev(p.rollout_logp),
                      old_values=dev(values), returns=dev(target.returns),
                      value_mask=dev(target.value_mask), mini_batches=p.layout.mini_batches)
  grads = {"policy": _grads(policy, "policy", cfg, batch)}
  if critic is not None:
    grads["value"] = _grads(critic, "value", cfg, batch)
  arrays = dict(old_logp=old_logp, advantages=target.advantages, values=values,
                returns=target.returns, value_mask=target.value_mask)
  mismatch = mismatch_metrics(old_logp, p.rollout_logp, p.loss_mask, cap=1.5,
                              segment_ids=p.segment_ids)
  return arrays, grads, mismatch


# Every aggregation mode, both algorithms and critic masks, each per-sample correction, GSPO's
# sequence ratio, and mini-batches by sample count (0) and by rows (4): each case compiles three
# layouts' updates, so the combinations are spread over six cases rather than crossed.
CASES = [("grpo", "token-mean", "policy_tokens", "ppo", "geo_mask", 4),
         ("grpo", "seq-mean-token-sum-norm", "policy_tokens", "gspo", "seq_tis", 0),
         ("grpo", "chunk-token-mean", "policy_tokens", "ppo", "none", 4),
         ("ppo", "token-mean", "policy_tokens", "ppo", "none", 0),
         ("ppo", "chunk-token-mean", "reference", "ppo", "none", 0),
         ("ppo", "seq-mean-token-mean", "reference", "ppo", "seq_mask", 4)]


@pytest.mark.parametrize("algo_name,agg,value_mask,policy_loss,correction,rows", CASES)
def test_packed_equals_unpacked(algo_name, agg, value_mask, policy_loss, correction, rows):
  dialogues = _dialogues(np.random.RandomState(len(agg) + rows))
  policy = create_model(CFG, dtype=jnp.float32, seed=1)
  critic = None
  if algo_name == "ppo":
    critic = create_model(CFG, head="value", dtype=jnp.float32, seed=2)
    critic.value_head[...] = jax.random.normal(jax.random.key(0), (CFG.hidden_size,)) * 0.1
  algo = GRPO() if algo_name == "grpo" else PPO(value_mask=value_mask, lam=0.9, gamma=0.95)
  cfg = LossConfig(agg=agg, chunks=3, norm_len=64, policy_loss=policy_loss, entropy_coef=0.01,
                   clip_low=3e-2, clip_high=4e-2, is_correction=correction,
                   is_cap=None if correction == "none" else 1.5)
  layouts = _layouts(dialogues, rows)
  one, packed, long = layouts
  assert packed.layout.rows <= one.layout.rows and long.layout.length > one.layout.length
  seg = packed.segment_ids
  assert (seg.max(1) > seg.min(1, initial=99, where=seg > 0)).any()  # a row holds several samples
  runs = [_run(p, algo, dialogues, policy, critic, cfg) for p in layouts]
  want_arrays, want_grads, want_mismatch = runs[0]
  for p, (arrays, grads, mismatch) in zip(layouts[1:], runs[1:]):
    for k, v in arrays.items():
      if v is None:
        continue
      T = one.layout.length
      for a, b in zip(_per_sample(one, want_arrays[k], T), _per_sample(p, v, T)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-6, err_msg=k)
      if k not in ("old_logp", "values"):  # 0 off the samples: nothing lands elsewhere
        assert abs(float(np.abs(v).sum()) - float(np.abs(want_arrays[k]).sum())) < 1e-3, k
    for loss, per_part in grads.items():
      for (l_want, g_want), (l, g) in zip(want_grads[loss], per_part):
        np.testing.assert_allclose(l, l_want, rtol=1e-5, atol=1e-7, err_msg=loss)
        for a, b in zip(jax.tree.leaves(g_want), jax.tree.leaves(g)):
          np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7 + 1e-4 * np.abs(a).max(), err_msg=loss)
    for k, v in want_mismatch.items():
      np.testing.assert_allclose(mismatch[k], v, rtol=1e-5, atol=1e-9, err_msg=k)


def test_packing_keeps_each_sample_in_its_mini_batch_and_cuts_padding():
  dialogues = _dialogues(np.random.RandomState(0), n=24)
  one, packed, _ = _layouts(dialogues, 8)
  M = one.layout.mini_batches
  assert M == 5 and packed.layout.mini_batches == M
  mini = lambda p, k: (p.at[k][0] // p.layout.micro_rows) % M
  assert [mini(one, k) for k in range(one.num_real)] == [mini(packed, k) for k in range(one.num_real)]
  real = (one.segment_ids > 0).sum()
  assert (packed.segment_ids > 0).sum() == real
  assert packed.tokens.size < 0.75 * one.tokens.size


def test_samples_by_hand():
  seg = np.array([[1, 1, 1, 0, 2, 2, 3, 0], [4, 4, 0, 0, 0, 0, 0, 0]], np.int32)
  np.testing.assert_array_equal(np.asarray(samples.positions(jnp.asarray(seg))),
                                [[0, 1, 2, 3, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
  np.testing.assert_array_equal(samples.runs(seg, np), [[0, 0, 0, 0, 1, 1, 2, 2], [3] * 8])
  loss = np.array([[0, 1, 1, 0, 0, 1, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]], np.float32)
  # Each sample's mask runs from its first policy token through the slot past its last token, if
  # that slot is its own padding (sample 2 is followed by sample 3 at once).
  np.testing.assert_array_equal(reference_value_mask(loss, seg),
                                [[0, 1, 1, 1, 0, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]])


def test_packed_places_fit_and_take_few_shapes():
  """Samples never overlap or leave their row, and packed shapes still come from few buckets (each
  new one recompiles the update and scoring programs)."""
  rng = np.random.default_rng(0)
  shapes = set()
  for _ in range(100):
    n, longest = int(rng.integers(1, 200)), int(rng.integers(1, 8193))
    lengths = [longest] + [int(x) for x in rng.integers(1, longest + 1, size=n - 1)]
    layout, places = step_places(lengths, 8, mini_batch_rows=0, mini_batches=1, shards=1,
                                 pack_length=0)
    used = np.zeros((layout.rows, layout.length), int)
    for (row, at), L in zip(places, lengths):
      assert at + L <= layout.length
      used[row, at:at + L] += 1
    assert used.max() == 1 and used.sum() == sum(lengths)
    assert layout.rows <= 1.5 * max(n, 8) and layout.rows % layout.micro_rows == 0
    shapes.add((layout.rows, layout.length))
  Ns, Ts = {s[0] for s in shapes}, {s[1] for s in shapes}
  assert len(Ns) <= 20 and len(Ts) <= 14, (sorted(Ns), sorted(Ts))  # `fine_bucket`: 4 an octave


def test_a_sample_as_long_as_an_unpacked_row_gets_no_slot_past_it_in_a_longer_row():
  # One a row, a sample of the row's whole length has no slot past its end; packed into a longer
  # row with padding after it, the reference critic mask must not gain that slot either.
  rng = np.random.RandomState(3)
  dialogues = _dialogues(rng, n=3)
  mask = np.zeros(64, np.float32)
  mask[5:20] = mask[30:64] = 1.0
  dialogues[-1].samples[-1] = SimpleNamespace(
      tokens=rng.randint(1, 50, size=64).tolist(), loss_mask=mask,
      sampler_logp=np.full(64, -3.0, np.float32), token_rewards={63: 1.0})
  one, _, long = _layouts(dialogues, 0)
  k = long.num_real - 1
  row, at = long.at[k]
  assert one.layout.length == 64 and at + 64 < long.layout.length
  assert long.segment_ids[row, at + 64] == 0  # padding follows it in its packed row
  critic = create_model(CFG, head="value", dtype=jnp.float32, seed=2)
  critic.value_head[...] = jax.random.normal(jax.random.key(0), (CFG.hidden_size,)) * 0.1
  algo = PPO(value_mask="reference", lam=0.9, gamma=0.95)
  out = []
  for p in (one, long):
    values = np.asarray(token_values(critic, jnp.asarray(p.tokens), jnp.asarray(p.segment_ids)))
    out.append(algo.targets(dialogues, p, p.rewards, values))
  assert out[1].value_mask[row, at + 64] == 0
  for name in ("value_mask", "advantages", "returns"):
    want, got = getattr(out[0], name), getattr(out[1], name)
    for a, b in zip(_per_sample(one, want, 64), _per_sample(long, got, 64)):
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-6, err_msg=name)
    assert abs(float(np.abs(got).sum()) - float(np.abs(want).sum())) < 1e-3, name
