"""score_branches: each branch's log-prob equals a full (uncached) forward of prefix + branch, the
extension factor included, for both KV layouts and on a sharded mesh; the cache is left bitwise as it was."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlver_jax.models import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.parallel.sharding import MeshConfig, make_mesh
from rlver_jax.sampling.branches import BranchQuery, score_branches
from rlver_jax.sampling.kv_cache import LAYOUTS
from rlver_jax.sampling.sampler import Sampler

V = 64
EXTEND = (9, 11, 13)
rng = np.random.default_rng(0)
# Row 0 and 2 get queries at a prefix shorter than what they hold (the rest must stay unseen);
# row 1 none; row 3 at its whole length.
ROWS = [rng.integers(1, V, 20).tolist(), rng.integers(1, V, 5).tolist(),
        rng.integers(1, V, 40).tolist(), rng.integers(1, V, 9).tolist()]
QUERIES = {0: (7, [(5,), (3, 9), (3, 9, 11), (12, 40, 41, 42)]),
           2: (33, [(9,), (13, 2), (60,)]),
           3: (9, [(1, 2, 3, 4, 5, 6), (7,)])}


@pytest.fixture(scope="module")
def model():
  cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, tie_word_embeddings=False, qkv_bias=True,
                    eos_token_id=5, pad_token_id=0)
  return create_model(cfg, dtype=jnp.float32, seed=3, init_std=0.3)


@pytest.fixture(scope="module")
def references(model):
  """Each query's branch log-probs from one uncached forward of prefix + branch per branch, all
  branches in one batch (right-padded: the model is causal, so the padding changes no kept logit)."""
  cases = [(b, n, br) for b, (n, branches) in QUERIES.items() for br in branches]
  L = max(n + len(br) for _, n, br in cases)
  tokens = np.zeros((len(cases), L), np.int32)
  for i, (b, n, br) in enumerate(cases):
    tokens[i, : n + len(br)] = ROWS[b][:n] + list(br)
  graphdef, state = nnx.split(model)
  logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(tokens))
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
  out = {}
  for i, (b, n, br) in enumerate(cases):
    tok = sum(logp[i, n - 1 + j, t] for j, t in enumerate(br))
    extend = np.exp(logp[i, n - 1 + len(br), list(EXTEND)]).sum()
    out.setdefault(b, []).append(tok + np.log1p(-extend))
  return out


def _check(references, sampler, params):
  cache, _ = sampler.prefill(params, sampler.init_cache(sampler.padded_rows(4)),
                             ROWS + [[]] * (sampler.padded_rows(4) - 4))
  before = jax.tree.map(np.asarray, cache)
  queries = {b: BranchQuery(n, ROWS[b][n - 1], tuple(br)) for b, (n, br) in QUERIES.items()}
  got = score_branches(sampler, params, cache, queries, extend_ids=EXTEND)
  assert sorted(got) == sorted(QUERIES)
  for b in QUERIES:
    np.testing.assert_allclose(got[b], references[b], rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.asarray, cache))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_branch_logprobs_equal_full_forward(model, references, layout):
  sampler = Sampler(model, max_len=64, stop_ids=[5], append_buckets=(8, 32), min_window=16,
                    cache_layout=layout)
  _check(references, sampler, nnx.state(model))


def test_branch_logprobs_on_sharded_mesh(model, references):
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  sampler = Sampler(model, max_len=64, stop_ids=[5], append_buckets=(8, 32), min_window=16, mesh=mesh)
  with jax.set_mesh(mesh):
    sharded = create_model(model.config, mesh=mesh, dtype=jnp.float32, seed=3, init_std=0.3)
    _check(references, sampler, nnx.state(sharded))


def test_no_extension_and_bad_queries(model):
  sampler = Sampler(model, max_len=64, stop_ids=[5], append_buckets=(8, 32), min_window=16)
  params = nnx.state(model)
  cache, _ = sampler.prefill(params, sampler.init_cache(1), [ROWS[0]])
  got = score_branches(sampler, params, cache, {0: BranchQuery(4, ROWS[0][3], ((7, 8),))})[0]
  logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray([ROWS[0][:4] + [7, 8]]))[0], axis=-1))
  np.testing.assert_allclose(got, [logp[3, 7] + logp[4, 8]], rtol=1e-5)
  with pytest.raises(ValueError, match="non-empty branches"):
    BranchQuery(4, 1, ((),))
  with pytest.raises(ValueError, match="exceeds the largest bucket"):
    score_branches(sampler, params, cache, {0: BranchQuery(4, 1, ((1,) * 40,))})
