"""Draft-and-verify decode's caches: after rejections both hold exactly the kept text (an uncached
forward of it gives the same logits); new prompts, settings, budgets and stop sequences compile
nothing after warm-up; a shared prefix copied to both, and both rewound; an int8 target cache under a float draft
decodes as the plain int8 sampler."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlver_jax.sampling.speculative import SpeculativeSampler
from rlver_jax.sampling.strategies import SamplingParams
from test_sampler import CompileCounter
from test_speculative import (GREEDY, K, MAX_NEW, PROMPTS, V, _assert_same_decode, _plain, _rules,
                              _sampler, _speculative, drafts, target)  # noqa: F401


def test_caches_after_rejections_equal_an_uncached_forward(target, drafts):
  """After a sampled decode with rejections, both caches hold exactly each row's kept text: the
  returned logits and those after one more appended token equal an uncached forward of that text
  (the rejected proposals' slots, past each row's length, are never read)."""
  params, draft_params = nnx.state(target), nnx.state(drafts["noisy"])
  spec = SpeculativeSampler(_sampler(target), _sampler(drafts["noisy"]), K)
  res = _speculative(spec, params, draft_params, _rules(), None,
                     sampling=SamplingParams.make(temperature=0.8, top_p=0.9), key=3)
  assert res.accepted.sum() < res.proposed.sum()  # some proposals were rejected and rewound
  texts = [p + res.decode.row(b) for b, p in enumerate(PROMPTS)]
  lengths = [len(t) for t in texts]
  np.testing.assert_array_equal(np.asarray(res.decode.cache.lengths), lengths)
  np.testing.assert_array_equal(np.asarray(res.draft_cache.lengths), lengths)
  probe = [[17 + b] for b in range(len(PROMPTS))]
  draft_cache, draft_logits = spec.draft.append(draft_params, res.draft_cache, probe)
  cache, logits = spec.target.append(params, res.decode.cache, probe, res.decode.logits)
  probed = [t + q for t, q in zip(texts, probe)]
  full, draft_full = _full_logits(target, probed), _full_logits(drafts["noisy"], probed)
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(np.asarray(res.decode.logits[b]), full[b, n - 1], atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits[b]), full[b, n], atol=1e-4)
    np.testing.assert_allclose(np.asarray(draft_logits[b]), draft_full[b, n], atol=1e-4)


def test_rewound_caches_decode_as_freshly_prefilled(target, drafts):
  """Both caches set back to the prompts after a sampled decode with rejections (a dialogue's
  rewind) give the greedy decode of freshly prefilled prompts: nothing past a length is read."""
  params, draft_params = nnx.state(target), nnx.state(drafts["noisy"])
  spec = SpeculativeSampler(_sampler(target), _sampler(drafts["noisy"]), K)
  want = _speculative(spec, params, draft_params, _rules(), None)
  res = _speculative(spec, params, draft_params, _rules(), None,
                     sampling=SamplingParams.make(temperature=1.0), key=5)
  assert res.accepted.sum() < res.proposed.sum()
  # The prompts' last token again: the logits after it come back with it.
  caches = spec.with_lengths((res.decode.cache, res.draft_cache), [len(p) - 1 for p in PROMPTS])
  caches, logits = spec.append(params, draft_params, caches, [p[-1:] for p in PROMPTS])
  got = spec.decode(params, draft_params, caches, logits, rng=jax.random.key(0),
                    max_new_tokens=MAX_NEW, sampling=GREEDY, stop_rules=_rules())
  _assert_same_decode(got.decode, want.decode)


def _full_logits(model, texts, width=64):
  """Uncached logits [B, width, V] of right-padded texts in one jitted call."""
  ids = np.zeros((len(texts), width), np.int32)
  segments = np.zeros_like(ids)
  for b, t in enumerate(texts):
    ids[b, :len(t)], segments[b, :len(t)] = t, 1
  run = jax.jit(lambda state, i, s: nnx.merge(nnx.graphdef(model), state)(i, segment_ids=s))
  return np.asarray(run(nnx.state(model), jnp.asarray(ids), jnp.asarray(segments)))


def test_shared_prefix_copied_to_both_caches(target, drafts):
  """A prefix prefilled once and copied to other rows (a GRPO group) decodes as if each row had
  prefilled it: the copy reaches the draft's cache too."""
  params, draft_params = nnx.state(target), nnx.state(drafts["noisy"])
  spec = SpeculativeSampler(_sampler(target), _sampler(drafts["noisy"]), K)
  B = len(PROMPTS)
  want = _speculative(spec, params, draft_params, _rules(), None, prompts=[PROMPTS[0]] * B)
  caches, logits = spec.prefill(params, draft_params, spec.init_caches(B), [PROMPTS[0]] + [[]] * (B - 1))
  caches, logits = spec.copy_rows(caches, logits, {b: 0 for b in range(1, B)})
  got = spec.decode(params, draft_params, caches, logits, rng=jax.random.key(0),
                    max_new_tokens=MAX_NEW, sampling=GREEDY, stop_rules=_rules())
  assert 0 < got.accepted.sum() < got.proposed.sum()
  _assert_same_decode(got.decode, want.decode)
  np.testing.assert_array_equal(np.asarray(got.draft_cache.lengths), np.asarray(want.draft_cache.lengths))


def test_no_recompiles_after_warmup(target, drafts):
  """New prompts (same bucket), sampling settings, budgets, stop sequences and keys reuse the
  programs compiled by the first turn."""
  params, draft_params = nnx.state(target), nnx.state(drafts["noisy"])
  spec = SpeculativeSampler(_sampler(target), _sampler(drafts["noisy"]), K)
  # Warm-up; the caches are then reused (allocating one compiles its zeros).
  res = _speculative(spec, params, draft_params, _rules(), None)
  counter = CompileCounter()
  rng = np.random.RandomState(0)
  settings = [SamplingParams.make(0.7, top_p=0.9), SamplingParams.make(1.2, top_k=5), GREEDY]
  for turn, sampling in enumerate(settings):
    prompts = [rng.randint(6, V, size=rng.randint(1, 9)).tolist() for _ in PROMPTS]
    budget = rng.randint(1, MAX_NEW + 1, size=len(PROMPTS))
    active = np.arange(len(PROMPTS)) != turn  # one row sits each turn out
    seqs = [[rng.randint(6, V, size=2).tolist()] for _ in PROMPTS]
    res = _speculative(spec, params, draft_params, _rules(seqs), budget, sampling, key=turn,
                       prompts=prompts, caches=(res.decode.cache, res.draft_cache), active=active)
    assert (res.decode.num_tokens <= budget).all() and res.decode.num_tokens[turn] == 0
    np.testing.assert_array_equal(np.asarray(res.draft_cache.lengths),
                                  [len(p) + n for p, n in zip(prompts, res.decode.num_tokens)])
  assert counter.count == 0


def test_int8_target_cache_with_a_one_token_draft(target, drafts):
  """An int8 target cache (a frozen simulator's) under a float draft: the plain int8 decode's
  greedy tokens, with proposals both kept and rejected. One draft token per pass (k = 1: the draft
  then never caches a proposal of its own before the verify) in the program this test compiles anyway."""
  params, draft_params = nnx.state(target), nnx.state(drafts["noisy"])
  plain = _sampler(target, cache_dtype=jnp.int8)
  want = _plain(plain, params, _rules(), None)
  spec = SpeculativeSampler(_sampler(target, cache_dtype=jnp.int8), _sampler(drafts["noisy"]), 1)
  got = _speculative(spec, params, draft_params, _rules(), None)
  assert got.decode.cache.int8 and not got.draft_cache.int8
  assert 0 < got.accepted.sum() < got.proposed.sum()
  # The verify pass projects k + 1 tokens in one matmul, the plain decode one: their K/V differ in
  # the last float bit, which can move a value sitting on a rounding boundary by one int8 step (a
  # ~1e-3 change of later log-probs and logits). The kept slots' codes agree to that step, the
  # tokens exactly.
  assert want.cache.layout == "heads_major"  # k/v [L, B, K, S, Dh] on CPU
  L, B, K, S, _ = want.cache.k.shape
  kept = np.broadcast_to((np.arange(S) < np.asarray(want.cache.lengths)[:, None])[:, None], (B, K, S))
  for name in ("k", "v"):
    a, b = (np.asarray(getattr(c, name), np.int32) for c in (got.decode.cache, want.cache))
    steps = np.abs(a - b)[:, kept]  # [L, kept slots of every row and head, Dh]
    assert steps.max() <= 1 and (steps > 0).mean() < 0.01, (name, steps.max(), (steps > 0).mean())
  _assert_same_decode(got.decode, want, atol=5e-3)
  np.testing.assert_array_equal(np.asarray(got.draft_cache.lengths), np.asarray(want.cache.lengths))
