"""Speculative sampling keeps the target's distribution: the rule alone on fixed distributions (each
emitted token ~ p, the acceptance rate sum(min(p, q))), and the whole draft-and-verify decode on a
16-token vocabulary, whose first three generated tokens follow the target's own temperature / top-p /
top-k distribution (chi-square against probabilities computed in float64 numpy from uncached
forwards), while the draft's own distribution is rejected by the same counts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from rlver_jax.models import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.sampling.draft_rule import draw, verify
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.speculative import SpeculativeSampler
from rlver_jax.sampling.strategies import SamplingParams
from test_speculative import _noisy

V, K, ROWS = 16, 2, 4000
PROMPT = [3, 7, 2]


def _log(p):
  p = np.asarray(p, np.float32)
  return np.where(p > 0, np.log(np.maximum(p, 1e-38)), -1e30).astype(np.float32)


def _chi_square(counts, expected):
  """(statistic, p-value) over cells with expected >= 5, the rest pooled into one cell; a draw in a
  cell of expected 0 fails at once."""
  counts, expected = np.ravel(counts), np.ravel(expected)
  assert counts[expected == 0].sum() == 0, "drew a token the target cannot sample"
  big = expected >= 5
  c = np.append(counts[big], counts[~big].sum())
  e = np.append(expected[big], expected[~big].sum())
  keep = e > 0
  return stats.chisquare(c[keep], e[keep] * c[keep].sum() / e[keep].sum())


def test_rule_emits_the_target_distribution():
  """p_0 puts no mass where q_0 proposes most (as a top-p cut would) and mass where q_0 has none;
  every kept or resampled token is still ~ p, and x_0 is kept with probability sum(min(p_0, q_0))."""
  p = np.array([[0.0, 0.5, 0.2, 0.2, 0.1, 0.0],
                [0.3, 0.3, 0.0, 0.1, 0.1, 0.2],
                [0.1, 0.1, 0.1, 0.1, 0.1, 0.5]])
  q = np.array([[0.6, 0.1, 0.1, 0.1, 0.0, 0.1],
                [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
  n_draws = 40000
  p_logp = jnp.broadcast_to(jnp.asarray(_log(p)), (n_draws,) + p.shape)
  q_logp = jnp.broadcast_to(jnp.asarray(_log(q)), (n_draws,) + q.shape)

  @jax.jit
  def run(key):
    keys = jax.random.split(key, K + 1)
    x = jnp.stack([draw(keys[i], q_logp[:, i]) for i in range(K)], axis=1)
    n, y = verify(p_logp, q_logp, x, keys[K])
    first = jnp.where(n >= 1, x[:, 0], y)
    second = jnp.where(n >= 2, x[:, 1], y)
    return n, first, second

  n, first, second = (np.asarray(a) for a in run(jax.random.key(0)))
  _, p_first = _chi_square(np.bincount(first, minlength=6), p[0] * n_draws)
  later = n >= 1  # the second emitted token exists where x_0 was kept
  _, p_second = _chi_square(np.bincount(second[later], minlength=6), p[1] * later.sum())
  assert p_first > 1e-3 and p_second > 1e-3, (p_first, p_second)
  accept = np.minimum(p[0], q[0]).sum()  # 0.3
  assert abs(later.mean() - accept) < 4 * np.sqrt(accept * (1 - accept) / n_draws), later.mean()


def test_rule_with_one_hot_distributions_is_greedy():
  """Greedy: a proposal is kept iff it is the target's argmax; the replacement is that argmax."""
  hot = lambda t: _log(np.eye(V)[t])
  p_logp = jnp.asarray(np.stack([np.stack([hot(4), hot(9), hot(1)]), np.stack([hot(4), hot(9), hot(1)]),
                                 np.stack([hot(2), hot(9), hot(1)])]))
  x = jnp.asarray([[4, 9], [4, 3], [5, 9]])
  q_logp = jnp.asarray(np.stack([np.stack([hot(t) for t in row]) for row in np.asarray(x)]))
  n, y = verify(p_logp, q_logp, x, jax.random.key(0))
  assert np.asarray(n).tolist() == [2, 1, 0] and np.asarray(y).tolist() == [1, 9, 2]


@pytest.fixture(scope="module")
def models():
  """The target and a draft that agrees with it about half the time (measured 0.56-0.59 here), so
  kept runs, rejections and bonus tokens all occur often."""
  config = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
  target = create_model(config, dtype=jnp.float32, seed=0, init_std=0.2)
  return target, _noisy(target, 0.03)


def _reference(logits, temperature, top_p, top_k):
  """The sampling distribution over the last axis, in float64: temperature, the top-k, then the
  smallest set of most likely tokens whose mass reaches top_p (a token stays if the mass strictly
  ahead of it is < top_p), renormalised."""
  z = np.asarray(logits, np.float64) / temperature
  if top_k:
    kth = -np.sort(-z, axis=-1)[..., top_k - 1:top_k]
    z = np.where(z >= kth, z, -np.inf)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ahead = (p[..., None, :] * (p[..., None, :] > p[..., :, None])).sum(-1)
  p = np.where(ahead < top_p, p, 0.0)
  return p / p.sum(-1, keepdims=True)


def _marginals(model, settings):
  """(joint of tokens 1 and 2 [V, V], marginal of token 3 [V]) of the model's own sampling, from
  uncached forwards of every one- and two-token continuation of the prompt."""
  forward = jax.jit(lambda state, ids: nnx.merge(nnx.graphdef(model), state)(ids))
  state = nnx.state(model)
  grid = np.stack(np.meshgrid(np.arange(V), np.arange(V), indexing="ij"), -1).reshape(-1, 2)
  ids = np.concatenate([np.tile(PROMPT, (V * V, 1)), grid], axis=1)
  logits = np.asarray(forward(state, jnp.asarray(ids)))  # [V*V, len+2, V]
  dist = lambda at: _reference(logits[:, at], *settings)
  p1 = dist(len(PROMPT) - 1)[0]                       # after the prompt
  p2 = dist(len(PROMPT))[::V]                         # after each first token a
  p3 = dist(len(PROMPT) + 1).reshape(V, V, V)         # after each (a, b)
  joint = p1[:, None] * p2
  return joint, np.einsum("ab,abc->c", joint, p3)


@pytest.mark.parametrize("settings", [(0.7, 0.9, 0), (1.3, 1.0, 6)], ids=["T0.7-top_p0.9", "T1.3-top_k6"])
def test_decode_samples_the_targets_distribution(models, settings):
  """ROWS copies of one prompt, three tokens each (the first from the caller's logits, the next two
  from one verify pass: kept proposals, a resample after a rejection, or the bonus token)."""
  target, draft = models
  make = lambda m: Sampler(m, max_len=8, stop_ids=[-1], pad_id=0, append_buckets=(8,), min_window=8)
  spec = SpeculativeSampler(make(target), make(draft), K)
  params, draft_params = nnx.state(target), nnx.state(draft)
  caches, logits = spec.prefill(params, draft_params, spec.init_caches(ROWS), [PROMPT] * ROWS)
  temperature, top_p, top_k = settings
  res = spec.decode(params, draft_params, caches, logits, rng=jax.random.key(1), max_new_tokens=3,
                    sampling=SamplingParams.make(temperature, top_p=top_p, top_k=top_k))
  tokens = res.decode.tokens
  assert (res.decode.num_tokens == 3).all()
  acceptance = res.metrics()["draft_acceptance"]
  assert 0.3 < acceptance < 0.85, acceptance  # both kept and rejected proposals count here

  joint, third = _marginals(target, settings)
  pairs = np.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
  results = {"token 1": _chi_square(np.bincount(tokens[:, 0], minlength=V), joint.sum(1) * ROWS),
             "token 2": _chi_square(np.bincount(tokens[:, 1], minlength=V), joint.sum(0) * ROWS),
             "tokens 1-2": _chi_square(pairs, joint.ravel() * ROWS),
             "token 3": _chi_square(np.bincount(tokens[:, 2], minlength=V), third * ROWS)}
  print({name: (round(float(r.statistic), 1), round(float(r.pvalue), 3)) for name, r in results.items()})
  assert all(r.pvalue > 1e-3 for r in results.values()), results
  # The same counts reject the draft's own distribution: the test can tell the two apart.
  draft_joint, draft_third = _marginals(draft, settings)
  assert _chi_square_vs(pairs, draft_joint.ravel() * ROWS) < 1e-6
  assert _chi_square_vs(np.bincount(tokens[:, 2], minlength=V), draft_third * ROWS) < 1e-6


def _chi_square_vs(counts, expected):
  """p-value of counts against expected, counting draws where expected is 0 as a certain mismatch."""
  if counts[expected == 0].sum():
    return 0.0
  return _chi_square(counts, expected).pvalue


def test_each_row_follows_its_own_key(models):
  """With one key per row (the rollout's per-dialogue streams) a row's tokens, proposals and
  acceptances depend on its own key and text alone: the rows in another order give the same rows."""
  target, draft = models
  make = lambda m: Sampler(m, max_len=16, stop_ids=[9], pad_id=0, append_buckets=(8,), min_window=16)
  spec = SpeculativeSampler(make(target), make(draft), K)
  params, draft_params = nnx.state(target), nnx.state(draft)
  prompts = [[3, 7, 2], [5], [1, 1, 4, 8], [12, 6], [2, 2, 2, 15, 3]]
  keys = jax.random.split(jax.random.key(4), len(prompts))
  order = [3, 0, 4, 2, 1]
  out = []
  for rows in (list(range(len(prompts))), order):
    caches, logits = spec.prefill(params, draft_params, spec.init_caches(len(rows)),
                                  [prompts[r] for r in rows])
    res = spec.decode(params, draft_params, caches, logits, rng=keys[np.asarray(rows)],
                      max_new_tokens=10, sampling=SamplingParams.make(1.0))
    out.append({r: (res.decode.row(i), int(res.accepted[i])) for i, r in enumerate(rows)})
  assert out[0] == out[1]
  assert 0 < sum(a for _, a in out[0].values()) and len({len(t) for t, _ in out[0].values()}) > 1
