"""Draft-and-verify decode in the serving layout (data over cache rows x tensor over heads, MLP and
vocabulary) on the 8 fake CPU devices: the plain decode's greedy tokens on the same mesh, and a
sampled decode (top-p filters on a split vocabulary) whose caches end holding every token."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlver_jax.models import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.parallel.sharding import MeshConfig, make_mesh
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.speculative import SpeculativeSampler
from rlver_jax.sampling.strategies import SamplingParams

TARGET = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False, qkv_bias=True)
DRAFT = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                    num_kv_heads=2, head_dim=16, tie_word_embeddings=True)


def test_serving_layout_gives_the_plain_decodes_tokens():
  mesh = make_mesh(MeshConfig(4, 1, 2))
  with jax.set_mesh(mesh):
    target = create_model(TARGET, mesh=mesh, seed=3, dtype=jnp.float32, init_std=0.3)
    draft = create_model(DRAFT, mesh=mesh, seed=4, dtype=jnp.float32, init_std=0.3)
  make = lambda m: Sampler(m, max_len=64, stop_ids=[1], mesh=mesh, min_window=64, append_buckets=(32,))
  rng = np.random.RandomState(0)
  rows = [rng.randint(4, 64, size=rng.randint(3, 20)).tolist() for _ in range(8)]
  params, draft_params = nnx.state(target), nnx.state(draft)
  plain = make(target)
  cache, logits = plain.prefill(params, plain.init_cache(8), rows)
  greedy = SamplingParams.make(0.0)
  want = plain.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=16, sampling=greedy)
  assert want.stopped.any() and not want.stopped.all()

  spec = SpeculativeSampler(make(target), make(draft), 3)
  caches, logits = spec.prefill(params, draft_params, spec.init_caches(8), rows)
  got = spec.decode(params, draft_params, caches, logits, rng=jax.random.key(0), max_new_tokens=16,
                    sampling=greedy)
  np.testing.assert_array_equal(got.decode.tokens, want.tokens)
  np.testing.assert_array_equal(got.decode.num_tokens, want.num_tokens)
  np.testing.assert_allclose(np.asarray(got.decode.logits), np.asarray(want.logits), atol=1e-4)
  assert got.decode.cache.k.sharding.is_equivalent_to(want.cache.k.sharding, want.cache.k.ndim)

  caches, logits = spec.prefill(params, draft_params, (got.decode.cache, got.draft_cache), rows)
  sampled = spec.decode(params, draft_params, caches, logits, rng=jax.random.key(1),
                        max_new_tokens=16, sampling=SamplingParams.make(0.7, top_p=0.9))
  lengths = [len(r) + n for r, n in zip(rows, sampled.decode.num_tokens)]
  np.testing.assert_array_equal(np.asarray(sampled.decode.cache.lengths), lengths)
  np.testing.assert_array_equal(np.asarray(sampled.draft_cache.lengths), lengths)
  assert sampled.proposed.sum() > 0
