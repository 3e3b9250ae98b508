"""Stop rules inside the decode loop: stopping equals decoding on and truncating at the same point
(tokens, log-probs, the cache rows, the last logits), against a plain-Python reference of the rules,
and new table contents compile nothing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_checkpoints import make_hf_checkpoint
from rlver_jax.models import load_pretrained
from rlver_jax.sampling.kv_cache import KV_AXES
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.stop_rules import LINE_BREAK, PAD, StopRules, sequence_table
from rlver_jax.sampling.strategies import SamplingParams
from test_sampler import CompileCounter

EOS = 5
PROMPTS = [[3, 4, 8, 9, 10, 11], [7, 8, 9], [20, 21, 22, 23, 24], [36], [33, 34]]
T1 = SamplingParams.make(temperature=1.0)
CONTENT = 2  # a content bit of `classes`


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt")
  make_hf_checkpoint(path, std=0.3, eos=EOS, vocab=40)  # a small vocabulary: rules fire often
  return load_pretrained(str(path), dtype=jnp.float32)[0]


def _decode(sampler, params, rules=None, *, seed=0, max_new=24, cache=None):
  cache = sampler.init_cache(len(PROMPTS)) if cache is None else cache
  cache, logits = sampler.prefill(params, cache, PROMPTS)
  return sampler.decode(params, cache, logits, rng=jax.random.key(seed), max_new_tokens=max_new,
                        sampling=T1, stop_rules=rules)


def reference_stop(gen, seqs, gates, classes, bit) -> tuple[int, bool]:
  """(tokens kept, whether a rule ended the row), by the rules' definition, one token at a time."""
  armed = ready = False
  for t, tok in enumerate(gen):
    seen = gen[: t + 1]
    if bit:
      ready = ready or (armed and bool(classes[tok] & bit))
      if ready and classes[tok] & LINE_BREAK:
        return t + 1, True
    if any(seen[-len(s):] == list(s) for s in seqs if len(s) <= len(seen)):
      return t + 1, True
    armed = armed or (bit and any(seen[-len(g):] == list(g) for g in gates if len(g) <= len(seen)))
  return len(gen), False


def _slots(cache, b, n):
  """Row b's first n cached keys and values as [n, ...] host arrays."""
  axes = KV_AXES[cache.layout]
  take = lambda a: np.moveaxis(np.asarray(a), (axes.index("batch"), axes.index("cache_seq")), (0, 1))[b, :n]
  return take(cache.k), take(cache.v)


def _rules_from(full, vocab):
  """Rules built from a plain decode's own tokens, so that they fire: per row a 2-token sequence,
  a 1-token one, or a line rule (gate, content, line break) made of its tokens."""
  seqs = [[full[0][6:8]], [[full[1][9]], full[1][2:4]], [], [], [[full[4][5]]]]
  gates = [[], [], [full[2][2:4]], [[full[3][1]]], []]
  classes = np.zeros(vocab, np.uint8)
  classes[full[2][8]] |= LINE_BREAK
  classes[full[3][4]] |= LINE_BREAK
  classes[full[3][3]] |= CONTENT
  classes[[t for t in range(vocab) if t % 3 == 0]] |= CONTENT
  bits = [0, 0, CONTENT, CONTENT, 0]
  return seqs, gates, classes, bits


def test_stopping_equals_decoding_on_and_truncating(model):
  params = nnx.state(model)
  # No stop id: every plain row runs its full budget, so the rules below find their tokens.
  sampler = Sampler(model, max_len=64, stop_ids=[], append_buckets=(8,), min_window=32)
  plain = _decode(sampler, params)
  full = [plain.row(b) for b in range(len(PROMPTS))]
  assert min(len(r) for r in full) >= 10, full  # long enough for the rules below
  seqs, gates, classes, bits = _rules_from(full, model.config.vocab_size)
  rules = StopRules.make(len(PROMPTS), model.config.vocab_size, seqs=seqs, gates=gates,
                         classes=classes, content_bit=bits)
  res = _decode(sampler, params, rules)
  early = 0
  for b, prompt in enumerate(PROMPTS):
    n, hit = reference_stop(full[b], seqs[b], gates[b], classes, bits[b])
    early += n < len(full[b])
    assert res.row(b) == full[b][:n], b
    assert bool(res.rule_stopped[b]) == hit, b
    np.testing.assert_array_equal(res.sample_logp[b, :n], plain.sample_logp[b, :n])
    np.testing.assert_array_equal(res.model_logp[b, :n], plain.model_logp[b, :n])
    assert (res.tokens[b, n:] == 0).all() and (res.model_logp[b, n:] == 0).all()
    # The cache holds exactly the kept tokens, as the longer decode's did at that point.
    assert int(res.cache.lengths[b]) == len(prompt) + n
    for got, want in zip(_slots(res.cache, b, len(prompt) + n), _slots(plain.cache, b, len(prompt) + n)):
      np.testing.assert_array_equal(got, want)
  assert early >= 4, early  # the rules did end rows early
  # The last logits are those after each row's last kept token: re-running the kept text agrees.
  fresh, logits = sampler.prefill(params, sampler.init_cache(len(PROMPTS)),
                                  [p + res.row(b) for b, p in enumerate(PROMPTS)])
  np.testing.assert_allclose(np.asarray(res.logits), np.asarray(logits), atol=1e-5, rtol=1e-5)


def test_no_rules_and_unused_rules_give_the_plain_decode(model):
  params = nnx.state(model)
  sampler = Sampler(model, max_len=64, stop_ids=[EOS], append_buckets=(8,), min_window=32)
  plain = _decode(sampler, params, seed=3)
  assert plain.rule_stopped is None
  empty = _decode(sampler, params, StopRules.make(len(PROMPTS), model.config.vocab_size), seed=3)
  np.testing.assert_array_equal(empty.tokens, plain.tokens)
  np.testing.assert_array_equal(empty.model_logp, plain.model_logp)
  assert not empty.rule_stopped.any()


def test_new_table_contents_compile_nothing(model):
  params = nnx.state(model)
  sampler = Sampler(model, max_len=64, stop_ids=[EOS], append_buckets=(8,), min_window=32)
  V = model.config.vocab_size
  rng = np.random.RandomState(0)
  counter = CompileCounter()
  before, cache = None, sampler.init_cache(len(PROMPTS))
  for turn in range(4):
    n_seqs = int(rng.randint(1, 8))  # within one table bucket (8 sequences of up to 4 tokens)
    seqs = [[rng.randint(0, V, size=rng.randint(1, 4)).tolist() for _ in range(n_seqs)]
            for _ in PROMPTS]
    gates = [[rng.randint(0, V, size=2).tolist()] for _ in PROMPTS]
    classes = rng.randint(0, 4, size=V).astype(np.uint8)
    rules = StopRules.make(len(PROMPTS), V, seqs=seqs, gates=gates, classes=classes,
                           content_bit=rng.choice([0, CONTENT], size=len(PROMPTS)))
    cache = _decode(sampler, params, rules, seed=turn, cache=cache).cache
    if before is not None:
      assert counter.count == before, turn
    before = counter.count


def test_sequence_table_layout_and_bad_rules(model):
  table = sequence_table([[[7], [1, 2, 3]], [[4, 5, 6, 7, 8]]])
  assert table.shape == (2, 8, 8)
  assert table[0, 0].tolist() == [PAD] * 7 + [7]
  assert table[0, 1].tolist() == [PAD] * 5 + [1, 2, 3]
  assert (table[0, 2:] == PAD).all() and table[1, 0, 3:].tolist() == [4, 5, 6, 7, 8]
  with pytest.raises(ValueError, match="non-empty"):
    sequence_table([[[]]])
  sampler = Sampler(model, max_len=64, stop_ids=[EOS], append_buckets=(8,), min_window=32)
  params = nnx.state(model)
  V = model.config.vocab_size
  with pytest.raises(ValueError, match="for 2 rows; the cache has 5"):
    _decode(sampler, params, StopRules.make(2, V))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    _decode(sampler, params, StopRules.make(len(PROMPTS), V, seqs=[[[V + 3]]]))
  with pytest.raises(ValueError, match="content_bit"):
    StopRules.make(3, V, content_bit=[LINE_BREAK, 0, 0])
