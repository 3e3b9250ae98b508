"""Draft-and-verify decode (`sampling/speculative.py`) against the plain sampler: greedy tokens,
stops, budgets, log-probs, cache lengths and last logits identical for a draft that is mostly
rejected, one accepted unevenly across rows and the target as its own draft; a draft of another
vocabulary is refused. Caches, compiles and the int8 cache: test_speculative_caches.py; the sampling
distribution: test_speculative_sampling.py."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlver_jax.models import create_model
from rlver_jax.models.factory import abstract_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.speculative import SpeculativeSampler
from rlver_jax.sampling.stop_rules import StopRules
from rlver_jax.sampling.strategies import SamplingParams

EOS, V, K, MAX_NEW = 5, 96, 3, 20
PROMPTS = [[3, 4, 8, 9, 10, 11], [7, 8, 9], [20, 21, 22, 23, 24], [36], [33, 34]]
GREEDY = SamplingParams.make(temperature=0.0)
TARGET = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qkv_bias=True)
SMALL = Qwen2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def target():
  return create_model(TARGET, dtype=jnp.float32, seed=0, init_std=0.3)


def _noisy(model, std):
  """The model with N(0, std) added to every weight: a draft that agrees with it often, not always."""
  leaves, tree = jax.tree.flatten(nnx.state(model))
  noisy = [a + std * jax.random.normal(jax.random.key(i), a.shape) for i, a in enumerate(leaves)]
  return nnx.merge(nnx.graphdef(model), jax.tree.unflatten(tree, noisy))


@pytest.fixture(scope="module")
def drafts(target):
  return {"random": create_model(SMALL, dtype=jnp.float32, seed=1, init_std=0.3),
          "noisy": _noisy(target, 0.01), "self": target}


def _sampler(model, **kw):
  # One window (64) for every call: each model pair compiles one decode program.
  return Sampler(model, max_len=64, stop_ids=[EOS], pad_id=0, append_buckets=(8,), min_window=64, **kw)


def _rules(seqs=()):
  return StopRules.make(len(PROMPTS), V, seqs=seqs)


def _plain(sampler, params, rules, budget, sampling=GREEDY, key=0):
  cache, logits = sampler.prefill(params, sampler.init_cache(len(PROMPTS)), PROMPTS)
  return sampler.decode(params, cache, logits, rng=jax.random.key(key), max_new_tokens=MAX_NEW,
                        sampling=sampling, budget=budget, stop_rules=rules)


def _speculative(spec, params, draft_params, rules, budget, sampling=GREEDY, key=0, prompts=PROMPTS,
                 caches=None, active=None):
  caches = spec.init_caches(len(prompts)) if caches is None else caches
  caches, logits = spec.prefill(params, draft_params, caches, prompts)
  return spec.decode(params, draft_params, caches, logits, rng=jax.random.key(key),
                     max_new_tokens=MAX_NEW, sampling=sampling, budget=budget, stop_rules=rules,
                     active=active)


def _assert_same_decode(got, want, atol=1e-4):  # log-probs and last logits
  np.testing.assert_array_equal(got.num_tokens, want.num_tokens)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.stopped, want.stopped)
  np.testing.assert_array_equal(got.rule_stopped, want.rule_stopped)
  np.testing.assert_allclose(got.model_logp, want.model_logp, atol=atol)
  np.testing.assert_allclose(got.sample_logp, want.sample_logp, atol=atol)
  np.testing.assert_array_equal(np.asarray(got.cache.lengths), np.asarray(want.cache.lengths))
  np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=atol)


@pytest.mark.parametrize("draft", ["random", "noisy", "self"])
def test_greedy_tokens_equal_the_plain_decode(target, drafts, draft):
  """Stop ids, stop sequences and per-row budgets end each row where the plain greedy decode does,
  whatever the draft proposes; the draft's cache ends holding the same tokens."""
  params, draft_params = nnx.state(target), nnx.state(drafts[draft])
  plain = _sampler(target)
  budget = [MAX_NEW, 7, MAX_NEW, 13, MAX_NEW]
  free = _plain(plain, params, _rules(), budget)
  # Stop sequences taken from the free run's own text, mid-reply: rows 0 and 2 end on them.
  seqs = [[free.row(0)[9:11]], [], [free.row(2)[4:7]], [], []]
  want = _plain(plain, params, _rules(seqs), budget)
  assert want.rule_stopped[[0, 2]].all() and want.stopped[4] and want.num_tokens[1] == 7
  spec = SpeculativeSampler(_sampler(target), _sampler(drafts[draft]), K)
  got = _speculative(spec, params, draft_params, _rules(seqs), budget)
  _assert_same_decode(got.decode, want)
  np.testing.assert_array_equal(np.asarray(got.draft_cache.lengths), np.asarray(want.cache.lengths))
  m = got.metrics()
  # Each verify pass proposed k tokens; a row closes with at most one more target pass.
  assert (got.proposed % K == 0).all() and np.isin(got.passes - got.proposed // K, [0, 1]).all()
  if draft == "random":
    assert m["draft_acceptance"] < 0.1, m  # measured 0.004
  elif draft == "noisy":
    # Rows accept different amounts in the same passes: their lengths advance unevenly.
    rates = got.accepted / got.proposed
    assert 0.2 < m["draft_acceptance"] < 0.9 and rates.max() - rates.min() > 0.2, (m, rates)
  else:
    assert m["draft_acceptance"] == 1.0 and m["tokens_per_verify"] > 3, m  # measured 3.6


def test_the_draft_must_share_the_vocabulary(target):
  other = abstract_model(dataclasses.replace(SMALL, vocab_size=V + 1))  # nothing allocated
  with pytest.raises(ValueError, match=r"draft's vocabulary \(97 tokens\) differs from the target's \(96\)"):
    SpeculativeSampler(_sampler(target), _sampler(other), K)
