"""Sampler invariants: HF greedy parity, cached == full forward, append == re-prefill, compile counts,
sampling distributions, and mesh independence; the cache invariants for both KV layouts."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from hf_checkpoints import make_hf_checkpoint
from rlver_jax.models import load_pretrained
from rlver_jax.sampling.kv_cache import LAYOUTS
from rlver_jax.sampling.sampler import Sampler, window_buckets
from rlver_jax.sampling.strategies import SamplingParams, categorical, filter_logits, sample
from rlver_jax.parallel.sharding import MeshConfig, make_mesh

EOS = 5
GREEDY = SamplingParams.make(temperature=0.0)
PROMPTS = [[3, 4, 8, 9, 10, 11, 12, 40, 41], [7, 8, 9], [20, 21, 22, 23, 24], [60]]


@pytest.fixture(scope="module", params=[dict(arch="qwen2"), dict(arch="llama", tied=True, kv_heads=1)],
                ids=["qwen2", "llama-tied-mqa"])
def checkpoint(request, tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt")
  torch_model = make_hf_checkpoint(path, std=0.3, eos=EOS, **request.param)
  model, _ = load_pretrained(str(path), dtype=jnp.float32)
  return torch_model, model


def _sampler(model, **kw):
  kw.setdefault("max_len", 96)
  return Sampler(model, stop_ids=[EOS], pad_id=0, append_buckets=(8, 32), min_window=32, **kw)


def test_greedy_matches_transformers_generate(checkpoint):
  torch_model, model = checkpoint
  sampler = _sampler(model)
  params = nnx.state(model)
  cache, logits = sampler.prefill(params, sampler.init_cache(len(PROMPTS)), PROMPTS)
  res = sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=24, sampling=GREEDY)
  for b, prompt in enumerate(PROMPTS):
    ref = torch_model.generate([prompt], max_new_tokens=24, do_sample=False,
                               eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
    assert res.row(b) == ref
    assert res.num_tokens[b] == len(ref)
    assert res.stopped[b] == (ref[-1] == EOS)


def test_no_stop_greedy_matches_timed_generate(checkpoint):
  """The decode benchmark's protocol (`benchmarks/decode_throughput.py`): no stop ids on our side,
  EOS off in the worker's timed `generate`; both give exactly `new` equal tokens per row."""
  torch_model, model = checkpoint
  prompts, new = [PROMPTS[2], [30, 31, 32, 33, 34]], 16
  sampler = Sampler(model, max_len=32, stop_ids=[-1], pad_id=0, append_buckets=(8, 32), min_window=32)
  params = nnx.state(model)
  cache, logits = sampler.prefill(params, sampler.init_cache(2), prompts)
  res = sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=new, sampling=GREEDY)
  ref, seconds = torch_model.timed_generate(prompts, new, 0, do_sample=False)
  assert ref.shape == (2, new) and seconds > 0
  assert [res.row(b) for b in range(2)] == ref.tolist()


def _full_logprobs(model, tokens):
  logits = model(jnp.asarray([tokens]))[0]
  return np.asarray(jax.nn.log_softmax(logits, axis=-1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cached_steps_equal_full_forward(checkpoint, layout):
  _, model = checkpoint
  sampler = _sampler(model, cache_layout=layout)
  params = nnx.state(model)
  # Token by token through append: the logits at every step equal the uncached forward's.
  seq = [3, 17, 29, 4, 55, 9, 81, 2, 33, 70]
  full = np.asarray(model(jnp.asarray([seq]))[0])
  cache = sampler.init_cache(1)
  for t, tok in enumerate(seq):
    cache, logits = sampler.append(params, cache, [[tok]])
    np.testing.assert_allclose(np.asarray(logits[0]), full[t], atol=2e-5, rtol=1e-5)
  # And the decode loop's raw log-probs equal the uncached log-softmax at every generated token.
  cache, logits = sampler.prefill(params, sampler.init_cache(2), PROMPTS[:2])
  res = sampler.decode(params, cache, logits, rng=jax.random.key(3), max_new_tokens=12,
                       sampling=SamplingParams.make(temperature=1.0))
  for b in range(2):
    gen = res.row(b)
    lp = _full_logprobs(model, PROMPTS[b] + gen)
    want = [lp[len(PROMPTS[b]) - 1 + i, tok] for i, tok in enumerate(gen)]
    np.testing.assert_allclose(res.model_logp[b, : len(gen)], want, atol=1e-4)
    # At T=1 with no truncation the sampling distribution is the model's.
    np.testing.assert_allclose(res.sample_logp[b, : len(gen)], want, atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_equals_reprefill(checkpoint, layout):
  _, model = checkpoint
  params = nnx.state(model)
  a = [[3, 4, 8, 9], [7, 8, 9, 10, 11, 12, 13]]
  b = [[30, 31, 32], [44]]
  sp = SamplingParams.make(temperature=0.8, top_p=0.9, top_k=20)
  s1 = _sampler(model, cache_layout=layout)
  assert s1.init_cache(2).layout == layout
  cache, logits = s1.prefill(params, s1.init_cache(2), a)
  r1 = s1.decode(params, cache, logits, rng=jax.random.key(1), max_new_tokens=6, sampling=sp)
  cache, logits = s1.append(params, r1.cache, b)
  r2 = s1.decode(params, cache, logits, rng=jax.random.key(2), max_new_tokens=8, sampling=sp)

  s2 = _sampler(model, cache_layout=layout)
  whole = [a[i] + r1.row(i) + b[i] for i in range(2)]
  cache, logits = s2.prefill(params, s2.init_cache(2), whole)
  r3 = s2.decode(params, cache, logits, rng=jax.random.key(2), max_new_tokens=8, sampling=sp)
  for i in range(2):
    assert r2.row(i) == r3.row(i)
  np.testing.assert_allclose(r2.sample_logp, r3.sample_logp, atol=1e-4)
  np.testing.assert_allclose(r2.model_logp, r3.model_logp, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(r2.cache.lengths), np.asarray(r3.cache.lengths))


class CompileCounter:
  """Counts XLA executables made: backend compilations and loads from the test process's persistent
  cache (an earlier test may have compiled the same program), not Python-level cache hits."""

  def __init__(self):
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_compile)
    jax.monitoring.register_event_listener(self._on_load)

  def _on_compile(self, event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      self.count += 1

  def _on_load(self, event, **kw):
    if event == "/jax/compilation_cache/cache_hits":
      self.count += 1


@pytest.mark.parametrize("cache_dtype", [None, jnp.int8], ids=["float", "int8"])
def test_no_recompiles_after_warmup(checkpoint, cache_dtype):
  _, model = checkpoint
  params = nnx.state(model)
  sampler = _sampler(model, max_len=128, cache_dtype=cache_dtype)
  rng = np.random.RandomState(0)
  cache = sampler.init_cache(2)
  counter = CompileCounter()
  windows = window_buckets(128, 32)
  fit = lambda n: min(w for w in windows if w >= n)
  seen, before = set(), counter.count
  for turn in range(6):
    n = [int(rng.randint(1, 8)), int(rng.randint(1, 8))]  # always the 8-token bucket
    rows = [rng.randint(6, 100, size=k).tolist() for k in n]
    lengths = np.asarray(cache.lengths)
    programs = {("append", fit(int((lengths + n).max()))), ("decode", fit(int((lengths + n).max()) + 4))}
    cache, logits = sampler.append(params, cache, rows)
    res = sampler.decode(params, cache, logits, rng=jax.random.key(turn), max_new_tokens=4,
                         sampling=SamplingParams.make(temperature=0.5 + 0.1 * turn, top_k=turn))
    cache = res.cache
    new = programs - seen
    seen |= programs
    # A program compiles once per attention window; new turn lengths inside the 8-token bucket
    # and new sampling settings compile nothing.
    if turn > 0:
      assert counter.count - before == len(new), (turn, new, counter.count - before)
    before = counter.count
  assert len(seen) >= 3  # the test did cross a window boundary


def test_topk1_equals_greedy():
  logits = jax.random.normal(jax.random.key(0), (16, 50)) * 3
  tok, slp, _ = sample(logits, jax.random.key(1), SamplingParams.make(temperature=1.3, top_k=1))
  np.testing.assert_array_equal(np.asarray(tok), np.asarray(jnp.argmax(logits, -1)))
  np.testing.assert_allclose(np.asarray(slp), 0.0, atol=1e-6)


def test_greedy_takes_the_first_maximum_like_argmax():
  """Ties go to the first index, a NaN wins (as in jnp.argmax), -inf rows still pick index 0."""
  nan, inf = np.nan, np.inf
  logits = np.array([[1.0, 3.0, 3.0, 2.0], [0.0, nan, 5.0, nan], [-inf, -inf, -inf, -inf],
                     [2.0, 2.0, 2.0, 2.0], [-1.0, -0.5, -0.5, -2.0]], np.float32)
  tok, slp, mlp = sample(jnp.asarray(logits), jax.random.key(0), SamplingParams.make(temperature=0.0))
  np.testing.assert_array_equal(np.asarray(tok), np.argmax(logits, axis=-1))
  np.testing.assert_array_equal(np.asarray(tok), [1, 1, 0, 0, 1])
  np.testing.assert_allclose(np.asarray(mlp)[[0, 3, 4]], [3 - np.log(2 * np.exp(3) + np.exp(2) + np.exp(1)),
                                                         -np.log(4), -0.5 - np.log(np.exp(-1) + 2 * np.exp(-0.5) + np.exp(-2))],
                             rtol=1e-6)
  assert (np.asarray(slp) == 0).all()


def test_temperature_one_matches_softmax_chi_square():
  from scipy import stats
  logits = jnp.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
  n = 20000
  keys = jax.random.split(jax.random.key(7), n)
  toks = jax.vmap(lambda k: sample(logits[None], k, SamplingParams.make(1.0))[0][0])(keys)
  counts = np.bincount(np.asarray(toks), minlength=6)
  expected = np.asarray(jax.nn.softmax(logits)) * n
  chi2, p = stats.chisquare(counts, expected)
  assert p > 0.01, (counts, expected, chi2)


@pytest.mark.parametrize("temperature,top_k", [(0.5, 0), (2.0, 3)])
def test_temperature_scales_the_distribution_chi_square(temperature, top_k):
  """First tokens ~ softmax(logits / T) (renormalised over the top k), against float64 numpy; the
  log-probs are log_softmax(logits / T) there and the model's log_softmax(logits)."""
  from scipy import stats
  raw = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
  n = 20000
  logits = jnp.broadcast_to(jnp.asarray(raw, jnp.float32), (n, len(raw)))  # n independent rows
  toks, slp, mlp = jax.jit(sample)(logits, jax.random.key(7), SamplingParams.make(temperature, top_k=top_k))
  toks = np.asarray(toks)
  kept = np.argsort(-raw)[:top_k] if top_k else np.arange(len(raw))
  z = np.full_like(raw, -np.inf)
  z[kept] = raw[kept] / temperature
  ref_slp = z - np.log(np.exp(z[kept]).sum())
  ref_mlp = raw - np.log(np.exp(raw).sum())
  counts = np.bincount(toks, minlength=len(raw))
  assert counts.sum() == counts[kept].sum()  # nothing drawn outside the top k
  chi2, p = stats.chisquare(counts[kept], np.exp(ref_slp[kept]) * n)
  assert p > 0.01, (counts, np.exp(ref_slp) * n, chi2)
  np.testing.assert_allclose(np.asarray(slp), ref_slp[toks], atol=1e-5)
  np.testing.assert_allclose(np.asarray(mlp), ref_mlp[toks], atol=1e-5)


@pytest.mark.parametrize("V", [3000, 49152])
def test_grid_draw_matches_softmax_on_a_wide_vocabulary(V):
  """The column-then-row draw over the [R, C] view gives softmax frequencies (tokens binned by
  probability, so the bins cut across rows and columns of the view)."""
  from scipy import stats
  logits = jax.random.normal(jax.random.key(V), (V,)) * 2.5
  n = 40000
  keys = jax.random.split(jax.random.key(11), n)
  toks = np.asarray(jax.jit(jax.vmap(lambda k: categorical(k, logits[None])[0]))(keys))
  probs = np.exp(np.asarray(logits, np.float64))
  probs /= probs.sum()
  order = np.argsort(-probs)
  bins = np.zeros(V, np.int64)  # consecutive tokens by probability, >= 200 expected draws per bin
  b, acc = 0, 0.0
  for t in order:
    bins[t] = b
    acc += probs[t] * n
    if acc >= 200:
      b, acc = b + 1, 0.0
  counts = np.bincount(bins[toks], minlength=bins.max() + 1)
  expected = np.bincount(bins, weights=probs * n, minlength=bins.max() + 1)
  assert len(counts) > 50
  chi2, p = stats.chisquare(counts, expected)
  assert p > 0.01, (chi2, p)


@pytest.mark.parametrize("tensor", [4, 1])
def test_sampling_never_gathers_the_logits(tensor):
  """With the filters compiled in (settings traced), over logits split by rows on data x fsdp and by
  vocabulary on tensor, only per-shard candidates, maxima and column masses cross devices: nothing
  near a [B, V] row block is ever gathered."""
  import re
  from rlver_jax.sampling.strategies import _CANDIDATES
  mesh = make_mesh(MeshConfig(data=1, fsdp=8 // tensor, tensor=tensor))
  settings = SamplingParams.make(0.7, top_p=0.9, top_k=20)
  for V in (49152, 151936, 152064):  # SmolLM2, Qwen2.5 0.5B-3B, Qwen2.5 7B+
    logits = jax.ShapeDtypeStruct((8, V), jnp.float32,
                                  sharding=NamedSharding(mesh, P(("data", "fsdp"), "tensor")))
    with jax.set_mesh(mesh):
      hlo = jax.jit(lambda k, l, s: sample(l, k, s)).lower(
          jax.random.key(0), logits, settings).compile().as_text()
    gathered = [math.prod(int(d) for d in dims.split(",") if d)
                for dims in re.findall(r"= \w+\[([\d,]*)\][^=]*? (?:all-gather|all-to-all|"
                                       r"collective-permute)\(", hlo)]
    assert max(gathered, default=0) <= 8 * tensor * _CANDIDATES, (V, gathered)
    assert 'custom_call_target="TopK"' in hlo  # the candidate path is compiled in


def test_top_p_keeps_exactly_the_nucleus():
  probs = np.array([0.05, 0.4, 0.25, 0.2, 0.1])
  logits = jnp.log(jnp.asarray(probs))[None]
  # Sorted: 0.4, 0.25, 0.2, 0.1, 0.05. Mass before each: 0, .4, .65, .85, .95.
  for top_p, kept in [(0.3, {1}), (0.5, {1, 2}), (0.65, {1, 2}), (0.7, {1, 2, 3}), (0.9, {1, 2, 3, 4}),
                      (1.0, {0, 1, 2, 3, 4})]:
    out = np.asarray(filter_logits(logits, jnp.int32(0), jnp.float32(top_p)))[0]
    assert set(np.nonzero(out > -1e29)[0]) == kept, top_p
  out = np.asarray(filter_logits(logits, jnp.int32(2), jnp.float32(1.0)))[0]
  assert set(np.nonzero(out > -1e29)[0]) == {1, 2}
  # Sampled tokens never leave the nucleus, and their log-probs are renormalised inside it.
  keys = jax.random.split(jax.random.key(0), 2000)
  toks, slp, mlp = jax.vmap(lambda k: sample(logits, k, SamplingParams.make(1.0, top_p=0.5)))(keys)
  assert set(np.asarray(toks).ravel()) == {1, 2}
  np.testing.assert_allclose(np.asarray(slp[toks == 1]), np.log(0.4 / 0.65), atol=1e-5)
  np.testing.assert_allclose(np.asarray(mlp[toks == 1]), np.log(0.4), atol=1e-5)


def _filter_reference(logits, top_k, top_p):
  """Sort-based top-k then top-p in float64 numpy, the definition written out."""
  out = np.full_like(logits, -np.inf)
  for b, row in enumerate(logits.astype(np.float64)):
    order = np.argsort(-row, kind="stable")
    k = len(row) if top_k == 0 else min(top_k, len(row))
    kept = row >= row[order[k - 1]]
    z = np.where(kept, row, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    # a token stays in the nucleus when the mass strictly more likely than it is < top_p
    ascending = np.sort(p)
    suffix = np.concatenate([np.cumsum(ascending[::-1])[::-1], [0.0]])  # suffix[i] = sum(ascending[i:])
    above = suffix[np.searchsorted(ascending, p, side="right")]
    keep = kept & ((above < top_p) if top_p < 1 else True)
    out[b] = np.where(keep, row, -np.inf)
  return out


_jit_filter = jax.jit(filter_logits)  # the settings are traced: one program per shape for all cases


@pytest.mark.parametrize("seed", range(4))
def test_filter_equals_sorting_reference(seed):
  """Cut-offs == the sort-based definition, on wide and peaked rows with tied logits (the wide rows
  send the whole batch to the bisection; each row alone the peaked ones to the candidates)."""
  r = np.random.default_rng(seed)
  V = 3000
  logits = r.standard_normal((4, V)).astype(np.float32) * np.array([[0.5], [2.0], [6.0], [1.0]], np.float32)
  logits[3, :300] = logits[3, 0]  # a block of ties
  for top_k, top_p in [(0, 0.9), (0, 0.5), (40, 1.0), (40, 0.8), (1, 1.0), (V + 5, 0.95), (0, 0.999)]:
    got = np.asarray(_jit_filter(jnp.asarray(logits), jnp.int32(top_k), jnp.float32(top_p)))
    ref = _filter_reference(logits, top_k, top_p)
    kept = got > -1e29
    np.testing.assert_array_equal(kept, np.isfinite(ref), err_msg=f"top_k={top_k} top_p={top_p}")
    np.testing.assert_array_equal(got[kept], logits[kept])
    for b in range(len(logits)):
      alone = np.asarray(_jit_filter(jnp.asarray(logits[b:b + 1]), jnp.int32(top_k), jnp.float32(top_p)))
      np.testing.assert_array_equal(alone[0], got[b], err_msg=f"row {b} top_k={top_k} top_p={top_p}")


_PEAKED_CASES = [(0, 0.9), (0, 0.5), (40, 1.0), (40, 0.8), (1, 1.0), (64, 1.0), (64, 0.999)]


def test_cuts_come_from_the_candidates_when_they_hold_them(monkeypatch):
  """Peaked rows (nuclei of < 64 tokens) and top_k <= 64 are cut from the 64 largest values alone:
  with the bisection broken (it would keep every token) the filter still equals the reference."""
  from rlver_jax.sampling import strategies
  r = np.random.default_rng(7)
  logits = (r.standard_normal((3, 3000)) * np.array([[6.0], [9.0], [4.0]])).astype(np.float32)
  logits[2, 1:5] = logits[2, 0]  # ties among the candidates
  monkeypatch.setattr(strategies, "_smallest_key_where", lambda keys, holds: jnp.zeros(keys.shape[:1], jnp.uint32))
  for top_k, top_p in _PEAKED_CASES:
    got = np.asarray(filter_logits(jnp.asarray(logits), jnp.int32(top_k), jnp.float32(top_p)))
    ref = _filter_reference(logits, top_k, top_p)
    np.testing.assert_array_equal(got > -1e29, np.isfinite(ref), err_msg=f"top_k={top_k} top_p={top_p}")
    if top_p < 1 or top_k:
      assert (got <= -1e29).any()  # the broken bisection would have kept everything


def test_filter_on_a_split_vocabulary_equals_one_device():
  """Under a mesh (rows over fsdp, vocabulary over tensor) both the candidate cut and the bisection
  keep exactly the single-device tokens."""
  mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
  r = np.random.default_rng(3)
  logits = (r.standard_normal((4, 4096)) * np.array([[0.5], [6.0], [9.0], [1.0]])).astype(np.float32)
  split = jax.device_put(logits, NamedSharding(mesh, P(("data", "fsdp"), "tensor")))
  filt = jax.jit(filter_logits)
  for top_k, top_p in [(0, 0.9), (20, 0.8), (100, 1.0), (0, 0.5)]:
    want = np.asarray(filter_logits(jnp.asarray(logits), jnp.int32(top_k), jnp.float32(top_p)))
    with jax.set_mesh(mesh):
      got = np.asarray(filt(split, jnp.int32(top_k), jnp.float32(top_p)))
      peaked = np.asarray(filt(split[1:3], jnp.int32(top_k), jnp.float32(top_p)))
    np.testing.assert_array_equal(got, want, err_msg=f"top_k={top_k} top_p={top_p}")
    np.testing.assert_array_equal(peaked, want[1:3], err_msg=f"top_k={top_k} top_p={top_p}")
  # A mesh that is not one of ours (other axis names): XLA places the top-k itself.
  other = jax.make_mesh((2, 4), ("rows", "cols"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(other):
    got = filt(jax.device_put(logits, NamedSharding(other, P("rows", "cols"))), jnp.int32(20),
               jnp.float32(0.8))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(filter_logits(
      jnp.asarray(logits), jnp.int32(20), jnp.float32(0.8))))


def test_budget_and_inactive_rows(checkpoint):
  _, model = checkpoint
  params = nnx.state(model)
  sampler = _sampler(model)
  cache, logits = sampler.prefill(params, sampler.init_cache(3), PROMPTS[:3])
  before = np.asarray(cache.lengths)
  res = sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=10,
                       sampling=SamplingParams.make(1.0), active=[True, False, True], budget=[3, 10, 10])
  assert res.num_tokens[0] <= 3 and res.num_tokens[1] == 0
  np.testing.assert_array_equal(np.asarray(res.cache.lengths), before + res.num_tokens)
  assert (res.tokens[1] == 0).all()


def test_reserve_keeps_slots_free_at_the_cache_end(checkpoint):
  _, model = checkpoint
  params = nnx.state(model)
  sampler = _sampler(model)
  cache, logits = sampler.prefill(params, sampler.init_cache(3), PROMPTS[:3])
  room = sampler.max_len - np.asarray(cache.lengths)
  res = sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=int(room.max()) + 5,
                       sampling=SamplingParams.make(1.0), budget=[int(room[0]) + 5, 2, int(room[2]) + 5],
                       reserve=1)
  # Rows 0 and 2 fill the cache up to its last slot, unless they hit a stop id first.
  assert ((res.num_tokens == room - 1) | res.stopped)[[0, 2]].all()
  assert res.num_tokens[1] <= 2
  assert (np.asarray(res.cache.lengths) <= sampler.max_len - 1).all()


@pytest.mark.parametrize("layout,ambient", [(l, True) for l in LAYOUTS] + [(LAYOUTS[0], False)])
def test_mesh_gives_single_device_results(tmp_path, layout, ambient, monkeypatch):
  """Also without the caller's jax.set_mesh: the sampler then traces under its own mesh, so the
  filters take their candidates per vocabulary shard (and the model's constraints apply)."""
  from rlver_jax.sampling import strategies
  seen = []
  top_values = strategies._top_values
  monkeypatch.setattr(strategies, "_top_values", lambda x, n: seen.append(
      strategies._vocab_split(*x.shape)[2]) or top_values(x, n))
  jax.clear_caches()  # trace both samplers' programs here, where `seen` records them
  make_hf_checkpoint(tmp_path, std=0.3, eos=EOS, heads=4, kv_heads=2, hidden=64)
  model1, _ = load_pretrained(str(tmp_path), dtype=jnp.float32)
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  model8, _ = load_pretrained(str(tmp_path), dtype=jnp.float32, mesh=mesh)
  prompts = PROMPTS  # 4 rows: divisible by data x fsdp
  results = []
  for model, m in [(model1, None), (model8, mesh)]:
    sampler = _sampler(model, mesh=m, cache_layout=layout)
    params = nnx.state(model)
    with jax.set_mesh(mesh) if m is not None and ambient else _null():
      cache, logits = sampler.prefill(params, sampler.init_cache(4), prompts)
      if m is not None:
        assert cache.k.sharding.spec[1] == ("data", "fsdp")
        assert cache.k.sharding.spec[2 if layout == "heads_major" else 3] == "tensor"
      res = sampler.decode(params, cache, logits, rng=jax.random.key(5), max_new_tokens=10,
                           sampling=SamplingParams.make(0.9, top_p=0.95))
    results.append(res)
  a, b = results
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.model_logp, b.model_logp, atol=1e-4)
  assert seen == [1, 2]  # traced once per sampler: unsplit, then over tensor=2


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


def test_token_ids_outside_the_vocabulary_are_refused(checkpoint):
  # On device such ids embed as NaN (or wrap around when negative) and poison the whole row.
  _, model = checkpoint
  params = nnx.state(model)
  V = model.config.vocab_size
  with pytest.raises(ValueError, match=f"pad_id {V} is not a token id"):
    Sampler(model, max_len=32, stop_ids=[EOS], pad_id=V)
  with pytest.raises(ValueError, match="pad_id -1"):
    Sampler(model, max_len=32, stop_ids=[EOS], pad_id=-1)
  sampler = _sampler(model)
  cache, logits = sampler.prefill(params, sampler.init_cache(2), PROMPTS[:2])
  for bad, message in ((V, f"row 1, position 2: token id {V} is outside"), (-3, "token id -3")):
    with pytest.raises(ValueError, match=message):
      sampler.append(params, cache, [[7], [8, 9, bad]], logits)
  # The refused calls did not consume (donate) the cache: it still decodes from the same state.
  np.testing.assert_array_equal(np.asarray(cache.lengths), [len(p) for p in PROMPTS[:2]])
  cache, logits = sampler.append(params, cache, [[V - 1], []], logits)
  assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("n", [0, -1, 2.0])
def test_max_new_tokens_must_be_a_positive_integer(checkpoint, n):
  _, model = checkpoint
  params = nnx.state(model)
  sampler = _sampler(model)
  cache, logits = sampler.prefill(params, sampler.init_cache(1), PROMPTS[:1])
  with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
    sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=n)


@pytest.mark.parametrize("settings", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                      dict(top_p=float("nan")), dict(temperature=-0.5),
                                      dict(top_k=2.7), dict(top_k=True), dict(top_k=-1)])
def test_bad_sampling_settings_are_refused(settings):
  with pytest.raises(ValueError, match="bad sampling settings"):
    SamplingParams.make(**settings)


def test_huge_top_k_keeps_everything_and_tiny_temperature_stays_finite():
  logits = jnp.array([[50.0, 49.0, 10.0, -3.0], [5.0, 50.0, 50.0, 1.0]])
  for k in (4, 3_000_000_000):  # past int32, and past the vocabulary: both mean "off"
    tokens, slp, _ = sample(logits, jax.random.key(1), SamplingParams.make(1.0, top_k=k))
    assert np.isfinite(np.asarray(slp)).all()
  # logits / 1e-37 overflow to inf; the sampler must still take the maximum (first of a tie).
  tokens, slp, mlp = sample(logits, jax.random.key(2), SamplingParams.make(1e-37))
  assert np.asarray(tokens)[0] == 0 and np.asarray(tokens)[1] in (1, 2)
  assert np.isfinite(np.asarray(slp)).all() and np.isfinite(np.asarray(mlp)).all()


def test_decoding_on_from_a_decode_equals_one_longer_decode(checkpoint):
  _, model = checkpoint
  params = nnx.state(model)
  sampler = _sampler(model)
  cache, logits = sampler.prefill(params, sampler.init_cache(3), PROMPTS[:3])
  once = sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=9, sampling=GREEDY)
  cache, logits = sampler.prefill(params, sampler.init_cache(3), PROMPTS[:3])
  first = sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=4, sampling=GREEDY)
  # Rows that stopped in the first call stay stopped (inactive); the others carry on.
  second = sampler.decode(params, first.cache, first.logits, rng=jax.random.key(0), max_new_tokens=5,
                          sampling=GREEDY, active=~first.stopped)
  for b in range(3):
    assert first.row(b) + second.row(b) == once.row(b)[: first.num_tokens[b] + second.num_tokens[b]]
    if not first.stopped[b]:
      assert first.row(b) + second.row(b) == once.row(b)
  np.testing.assert_array_equal(np.asarray(second.cache.lengths), np.asarray(once.cache.lengths))


def test_each_step_draws_with_its_own_key(checkpoint):
  """Step i samples with fold_in(rng, i): re-drawing every step from the full forward's logits with
  that key gives the same tokens (a loop reusing one key, or one per row, would not)."""
  _, model = checkpoint
  params = nnx.state(model)
  sampler = _sampler(model)
  t1 = SamplingParams.make(1.0)
  key = jax.random.key(11)
  cache, logits = sampler.prefill(params, sampler.init_cache(2), PROMPTS[:2])
  res = sampler.decode(params, cache, logits, rng=key, max_new_tokens=10, sampling=t1)
  seqs = [PROMPTS[b] + res.row(b) for b in range(2)]
  lps = [_full_logprobs(model, s) for s in seqs]
  for i in range(int(res.num_tokens.max())):
    step_logits = jnp.asarray(np.stack([lps[b][min(len(PROMPTS[b]) - 1 + i, len(seqs[b]) - 1)]
                                        for b in range(2)]))
    tokens, _, _ = sample(step_logits, jax.random.fold_in(key, i), t1)
    for b in range(2):
      if i < res.num_tokens[b]:
        assert int(tokens[b]) == res.tokens[b, i], (b, i)


def test_malformed_decode_arguments_are_refused(checkpoint):
  _, model = checkpoint
  params = nnx.state(model)
  sampler = _sampler(model)
  cache, logits = sampler.prefill(params, sampler.init_cache(3), PROMPTS[:3])
  call = lambda **kw: sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=4, **kw)
  with pytest.raises(ValueError, match=r"active has shape \(1,\); the cache has 3 rows"):
    call(active=[False])
  with pytest.raises(ValueError, match=r"budget has shape \(2,\)"):
    call(budget=[2, 2])
  with pytest.raises(ValueError, match="reserve must be >= 0"):
    call(reserve=-3)
  for kw in (dict(max_len=0), dict(max_len=32, min_window=0)):
    with pytest.raises(ValueError, match="must be >= 1"):
      Sampler(model, stop_ids=[EOS], **kw)
