"""Draft-and-verify decode in segments (`Sampler.decode_segment`, the simulator's default): greedy
tokens, stops (ids, sequences, budgets), log-probs and caches equal the plain decode's, and a sampled
decode leaves both caches holding every token, whatever segment boundaries cut a verify pass."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlver_jax.models import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.speculative import SpeculativeSampler
from rlver_jax.sampling.stop_rules import StopRules
from rlver_jax.sampling.strategies import SamplingParams

EOS, V, K, MAX_NEW, SEGMENT = 5, 96, 3, 20, 4
PROMPTS = [[3, 4, 8, 9, 10, 11], [7, 8, 9], [20, 21, 22, 23, 24], [36], [33, 34]]
TARGET = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qkv_bias=True)


def _sampler(model, segment=0):
  # One window (64) for every call: one decode program per model pair.
  return Sampler(model, max_len=64, stop_ids=[EOS], pad_id=0, append_buckets=(8,), min_window=64,
                 decode_segment=segment)


def test_segments_give_the_plain_decodes_tokens():
  target = create_model(TARGET, dtype=jnp.float32, seed=0, init_std=0.3)
  leaves, tree = jax.tree.flatten(nnx.state(target))
  noisy = [a + 0.01 * jax.random.normal(jax.random.key(i), a.shape) for i, a in enumerate(leaves)]
  params, draft_params = nnx.state(target), jax.tree.unflatten(tree, noisy)
  greedy = SamplingParams.make(0.0)
  budget = [MAX_NEW, 7, MAX_NEW, 13, MAX_NEW]

  plain = _sampler(target)
  def run_plain(rules):
    cache, logits = plain.prefill(params, plain.init_cache(len(PROMPTS)), PROMPTS)
    return plain.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=MAX_NEW,
                        sampling=greedy, budget=budget, stop_rules=rules)
  rules = lambda seqs=(): StopRules.make(len(PROMPTS), V, seqs=seqs)
  free = run_plain(rules())
  # Stop sequences across segment boundaries: row 0's at tokens 3-5, row 2's at 6-8.
  seqs = [[free.row(0)[3:6]], [], [free.row(2)[6:9]], [], []]
  want = run_plain(rules(seqs))
  assert want.rule_stopped[[0, 2]].all() and want.num_tokens[1] == 7

  spec = SpeculativeSampler(_sampler(target, SEGMENT), _sampler(target, SEGMENT), K)
  caches, logits = spec.prefill(params, draft_params, spec.init_caches(len(PROMPTS)), PROMPTS)
  got = spec.decode(params, draft_params, caches, logits, rng=jax.random.key(0),
                    max_new_tokens=MAX_NEW, sampling=greedy, budget=budget, stop_rules=rules(seqs))
  for name in ("tokens", "num_tokens", "stopped", "rule_stopped"):
    np.testing.assert_array_equal(getattr(got.decode, name), getattr(want, name), err_msg=name)
  np.testing.assert_allclose(got.decode.model_logp, want.model_logp, atol=1e-4)
  np.testing.assert_allclose(np.asarray(got.decode.logits), np.asarray(want.logits), atol=1e-4)
  for cache in (got.decode.cache, got.draft_cache):
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(want.cache.lengths))
  assert 0 < got.metrics()["draft_acceptance"] < 1  # rows kept different runs of proposals
  segments = -(-want.num_tokens.max() // SEGMENT)
  assert segments > 2 and spec.target.calls.take()["verify_calls"] == segments

  # Sampled (the same program): every segment's tokens land in both caches after the prompt.
  caches, logits = spec.prefill(params, draft_params, (got.decode.cache, got.draft_cache), PROMPTS)
  sampled = spec.decode(params, draft_params, caches, logits, rng=jax.random.key(1),
                        max_new_tokens=MAX_NEW, sampling=SamplingParams.make(0.7, top_p=0.9),
                        stop_rules=rules())
  lengths = [len(p) + n for p, n in zip(PROMPTS, sampled.decode.num_tokens)]
  assert (sampled.decode.num_tokens > SEGMENT).any()
  for cache in (sampled.decode.cache, sampled.draft_cache):
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
