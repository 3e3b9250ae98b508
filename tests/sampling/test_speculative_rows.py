"""A draft with fewer embedding rows than the target over the same tokenizer (Qwen2.5-0.5B pads its
vocabulary to 151,936 rows, Qwen2.5-72B to 152,064): it proposes no id past its rows, the target
keeps its own greedy tokens, and a draft that is the target cut to fewer rows is mostly kept."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlver_jax.models import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.speculative import SpeculativeSampler
from rlver_jax.sampling.strategies import SamplingParams

EOS, V, ROWS, K, MAX_NEW = 5, 96, 88, 3, 12
PROMPTS = [[3, 4, 8, 9, 10, 11], [7, 8, 9], [20, 21, 22, 23, 24], [36]]
TARGET = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qkv_bias=True)


def _sampler(model):
  return Sampler(model, max_len=64, stop_ids=[EOS], pad_id=0, append_buckets=(8,), min_window=64)


def test_a_draft_with_fewer_rows_keeps_the_targets_greedy_tokens():
  target = create_model(TARGET, dtype=jnp.float32, seed=0, init_std=0.3)
  cut = create_model(dataclasses.replace(TARGET, vocab_size=ROWS), dtype=jnp.float32, seed=1)
  params = nnx.state(target)
  weights = jax.tree.map(lambda a: a, params)
  weights["embed"] = nnx.Param(params["embed"][...][:ROWS])  # the target, its last rows dropped
  nnx.update(cut, weights)
  draft_params = nnx.state(cut)
  greedy = SamplingParams.make(0.0)

  plain = _sampler(target)
  cache, logits = plain.prefill(params, plain.init_cache(len(PROMPTS)), PROMPTS)
  want = plain.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=MAX_NEW,
                      sampling=greedy)
  spec = SpeculativeSampler(_sampler(target), _sampler(cut), K)
  caches, logits = spec.prefill(params, draft_params, spec.init_caches(len(PROMPTS)), PROMPTS)
  got = spec.decode(params, draft_params, caches, logits, rng=jax.random.key(0),
                    max_new_tokens=MAX_NEW, sampling=greedy)
  np.testing.assert_array_equal(got.decode.tokens, want.tokens)
  np.testing.assert_array_equal(got.decode.num_tokens, want.num_tokens)
  m = got.metrics()
  assert m["draft_acceptance"] > 0.5 and m["tokens_per_verify"] > 1.5, m


def test_ids_past_the_drafts_rows_reach_it_clamped_and_the_target_keeps_its_tokens():
  # The simulator's text may hold ids the draft has no row for (the target's padding rows): the
  # draft reads its last id instead (no out-of-range embedding read), the target's tokens stand.
  target = create_model(TARGET, dtype=jnp.float32, seed=0, init_std=0.3)
  cut = create_model(dataclasses.replace(TARGET, vocab_size=ROWS), dtype=jnp.float32, seed=1)
  params, draft_params = nnx.state(target), nnx.state(cut)
  greedy = SamplingParams.make(0.0)
  prompts = [[3, 90, 8, 95], [7, 8, 9]]
  more = [[91, 12], [93]]
  plain = _sampler(target)
  cache, logits = plain.prefill(params, plain.init_cache(2), prompts)
  cache, logits = plain.append(params, cache, more, logits)
  want = plain.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=MAX_NEW,
                      sampling=greedy)
  spec = SpeculativeSampler(_sampler(target), _sampler(cut), K)
  caches, logits = spec.prefill(params, draft_params, spec.init_caches(2), prompts)
  caches, logits = spec.append(params, draft_params, caches, more, logits)
  assert np.isfinite(np.asarray(caches[1].k, np.float32)).all()  # the draft read no row it lacks
  got = spec.decode(params, draft_params, caches, logits, rng=jax.random.key(0),
                    max_new_tokens=MAX_NEW, sampling=greedy)
  np.testing.assert_array_equal(got.decode.tokens, want.tokens)
  np.testing.assert_array_equal(got.decode.num_tokens, want.num_tokens)
