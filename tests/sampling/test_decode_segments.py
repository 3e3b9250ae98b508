"""A decode run in segments (Sampler decode_segment / window_step) is one decode: the same tokens,
log-probs, stops, cache and last logits as a single call, while each segment attends a smaller
window; stop rules that span a segment boundary still fire; no recompiles once its windows ran."""
import jax
import numpy as np
import pytest
from flax import nnx

from rlver_jax.sampling.sampler import Sampler, window_buckets
from rlver_jax.sampling.stop_rules import StopRules
from rlver_jax.sampling.strategies import SamplingParams
from test_sampler import CompileCounter
from test_stop_rules import EOS, PROMPTS, T1, _rules_from, _slots, model, reference_stop  # noqa: F401

GREEDY = SamplingParams.make(temperature=0.0)


def _pair(model, stop_ids, **kw):
  """(one call per decode, segments of 3 tokens with windows in steps of 16)."""
  make = lambda **more: Sampler(model, max_len=64, stop_ids=stop_ids, append_buckets=(8,),
                                min_window=8, **kw, **more)
  return make(), make(decode_segment=3, window_step=16)


def _decode(sampler, params, *, rng, sampling, rules=None, max_new=40, budget=None, cache=None):
  cache = sampler.init_cache(len(PROMPTS)) if cache is None else cache
  cache, logits = sampler.prefill(params, cache, PROMPTS)
  return sampler.decode(params, cache, logits, rng=rng, max_new_tokens=max_new, sampling=sampling,
                        budget=budget, stop_rules=rules)


def _assert_same(got, want):
  np.testing.assert_array_equal(got.num_tokens, want.num_tokens)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.stopped, want.stopped)
  np.testing.assert_allclose(got.model_logp, want.model_logp, atol=1e-5)
  np.testing.assert_allclose(got.sample_logp, want.sample_logp, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got.cache.lengths), np.asarray(want.cache.lengths))
  for b, prompt in enumerate(PROMPTS):
    n = len(prompt) + int(want.num_tokens[b])
    for g, w in zip(_slots(got.cache, b, n), _slots(want.cache, b, n)):
      np.testing.assert_allclose(g, w, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-4)


@pytest.mark.parametrize("keys", ["one key", "a key per row"])
@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "T=1"])
def test_segments_continue_one_decode(model, keys, sampling):
  params = nnx.state(model)
  whole, segmented = _pair(model, [EOS])
  key = jax.random.key(7)
  rng = key if keys == "one key" else jax.random.split(key, len(PROMPTS))
  budget = [40, 5, 17, 40, 1]  # rows that end mid-segment, on a boundary, after one token
  want = _decode(whole, params, rng=rng, sampling=sampling, budget=budget)
  got = _decode(segmented, params, rng=rng, sampling=sampling, budget=budget)
  assert want.num_tokens.max() > 9, want.num_tokens  # long enough to cross several segments
  _assert_same(got, want)
  whole_calls, calls = whole.calls.take(), segmented.calls.take()
  assert calls["decode_calls"] > whole_calls["decode_calls"] == 1
  # Every segment attends a window no larger than the single call's, most of them smaller.
  windows = lambda c: {int(k.split("/W")[1]): n for k, n in c.items() if k.startswith("decode_steps")}
  (w_whole,) = windows(whole_calls)
  assert max(windows(calls)) <= w_whole and min(windows(calls)) < w_whole
  assert sum(windows(calls).values()) == want.num_tokens.max()


def test_stop_rules_fire_across_segment_boundaries(model):
  params = nnx.state(model)
  whole, segmented = _pair(model, [])  # no stop id: only the rules end rows
  rng = jax.random.key(0)
  plain = _decode(whole, params, rng=rng, sampling=T1, max_new=24)
  full = [plain.row(b) for b in range(len(PROMPTS))]
  seqs, gates, classes, bits = _rules_from(full, model.config.vocab_size)
  rules = StopRules.make(len(PROMPTS), model.config.vocab_size, seqs=seqs, gates=gates,
                         classes=classes, content_bit=bits)
  want = _decode(whole, params, rng=rng, sampling=T1, rules=rules, max_new=24)
  got = _decode(segmented, params, rng=rng, sampling=T1, rules=rules, max_new=24)
  _assert_same(got, want)
  np.testing.assert_array_equal(got.rule_stopped, want.rule_stopped)
  for b in range(len(PROMPTS)):  # and both stop where the rules' definition says
    n, hit = reference_stop(full[b], seqs[b], gates[b], classes, bits[b])
    assert got.row(b) == full[b][:n] and bool(got.rule_stopped[b]) == hit, b
  assert got.rule_stopped.sum() >= 3


def test_segments_compile_one_program_per_window(model):
  params = nnx.state(model)
  _, segmented = _pair(model, [EOS])
  decode_windows = lambda: {k for k in segmented.calls.take() if k.startswith("decode_steps")}
  # warm-up: its windows compile (one cache throughout: allocating one compiles its zeros)
  cache = _decode(segmented, params, rng=jax.random.key(1), sampling=T1).cache
  seen = decode_windows()
  counter = CompileCounter()
  cache = _decode(segmented, params, rng=jax.random.key(1), sampling=T1, cache=cache).cache
  assert counter.count == 0  # the same stream again: every segment's program is there
  for seed in range(2, 6):  # other streams end rows elsewhere: only a window not seen compiles
    before = counter.count
    cache = _decode(segmented, params, rng=jax.random.key(seed), sampling=T1, cache=cache).cache
    new = decode_windows() - seen
    assert counter.count - before <= len(new), (seed, new)
    seen |= new


def test_window_buckets():
  assert window_buckets(16384) == (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
  assert window_buckets(8192, 64, 1024) == (64, 128, 256, 512, 1024, 2048, 3072, 4096, 5120, 6144,
                                            7168, 8192)
  assert window_buckets(20480, 64, 3000) == (64, 128, 256, 512, 1024, 2048, 3000, 6000, 9000,
                                             12000, 15000, 18000, 20480)
  assert window_buckets(1000, 64, 1024) == (64, 128, 256, 512, 1000)


def test_bad_segment_settings_are_refused(model):
  with pytest.raises(ValueError, match="decode_segment"):
    Sampler(model, max_len=64, stop_ids=[EOS], decode_segment=-1)
