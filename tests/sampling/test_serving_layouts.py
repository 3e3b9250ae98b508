"""Decoding in a serving layout (tensor parallel over heads x data over cache rows) on the 8 fake CPU
devices: the tokens of the training layout (FSDP), for a policy's decode copy and for a simulator
born on its own mesh, also under another ambient mesh; no weight-sized all-gather per step; a
refreshed decode copy compiles nothing new."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlver_jax.aot import collectives
from rlver_jax.models import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.parallel.sharding import MeshConfig, make_mesh
from rlver_jax.sampling.decode_copy import DecodeCopy
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams
from test_sampler import CompileCounter

# 4 q / 2 kv heads: the serving layout's tensor axis (2) splits heads, MLP and vocabulary.
CONFIG = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False,
                     qkv_bias=True)
TRAIN, SERVE = MeshConfig(1, 8, 1), MeshConfig(4, 1, 2)
GREEDY = SamplingParams.make(temperature=0.0)


@pytest.fixture(scope="module")
def meshes():
  return make_mesh(TRAIN), make_mesh(SERVE)


def _rows(seed: int, n: int = 8) -> list[list[int]]:
  rng = np.random.RandomState(seed)
  return [rng.randint(4, CONFIG.vocab_size, size=rng.randint(3, 20)).tolist() for _ in range(n)]


def _dialogue(sampler: Sampler, params):
  """Two turns: prefill, greedy decode, append, greedy decode; (tokens, model log-probs) of both."""
  cache, logits = sampler.prefill(params, sampler.init_cache(8), _rows(0))
  first = sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=10,
                         sampling=GREEDY)
  cache, logits = sampler.append(params, first.cache, _rows(1))
  second = sampler.decode(params, cache, logits, rng=jax.random.key(1), max_new_tokens=10,
                          sampling=GREEDY)
  return (np.concatenate([first.tokens, second.tokens], 1),
          np.concatenate([first.model_logp, second.model_logp], 1), second.cache)


def _sampler(model, mesh) -> Sampler:
  return Sampler(model, max_len=128, stop_ids=[1], mesh=mesh)


def _trained_policy(mesh):
  """fp32 master weights in the training layout, bf16 compute (the trainer's policy)."""
  with jax.set_mesh(mesh):
    return create_model(CONFIG, mesh=mesh, seed=3, param_dtype=jnp.float32, dtype=jnp.bfloat16)


def test_policy_decode_copy_in_a_serving_layout_gives_the_training_layouts_tokens(meshes):
  train, serve = meshes
  policy = _trained_policy(train)
  master = nnx.state(policy, nnx.Param)
  with jax.set_mesh(train):
    want_tokens, want_logp, _ = _dialogue(_sampler(policy, train), master)
    # The trainer's situation: its mesh is the ambient one while the rollout decodes in its own.
    copy = DecodeCopy(master, serve, jnp.bfloat16).refresh(master)
    tokens, logp, cache = _dialogue(_sampler(policy, serve), copy)
  assert copy["layers"]["wq"][...].dtype == jnp.bfloat16
  wq = copy["layers"]["wq"][...]
  assert wq.sharding.mesh == serve and wq.sharding.shard_shape(wq.shape) == (2, 64, 2, 16)
  assert (want_tokens != 0).sum() > 40  # the rows did decode
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_allclose(logp, want_logp, atol=2e-2)
  # The cache is split over kv heads (tensor) x rows (data): every device holds 1/8 of it.
  assert cache.k.sharding.shard_shape(cache.k.shape) == (2, 2, 1, 128, 16)


@pytest.mark.parametrize("ambient", [None, "train"])
def test_a_simulator_born_on_its_own_mesh_gives_the_training_layouts_tokens(meshes, ambient):
  train, serve = meshes
  born = {}
  for name, mesh in (("train", train), ("serve", serve)):
    with jax.set_mesh(mesh):  # frozen bf16 weights, as the simulator loads them
      born[name] = create_model(CONFIG, mesh=mesh, seed=5, param_dtype=jnp.bfloat16,
                                dtype=jnp.bfloat16)
  with jax.set_mesh(train):
    want_tokens, want_logp, _ = _dialogue(_sampler(born["train"], train),
                                          nnx.state(born["train"], nnx.Param))
  sim = born["serve"]
  assert sim.layers.w_up[...].sharding.mesh == serve
  if ambient is None:
    tokens, logp, _ = _dialogue(_sampler(sim, serve), nnx.state(sim, nnx.Param))
  else:
    with jax.set_mesh(train):
      tokens, logp, _ = _dialogue(_sampler(sim, serve), nnx.state(sim, nnx.Param))
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_allclose(logp, want_logp, atol=2e-2)


def _largest_all_gather(sampler: Sampler, params) -> int:
  """Bytes of the largest all-gather result in the compiled decode program."""
  cache = sampler.init_cache(8)
  logits = sampler.empty_logits(8)
  with sampler._on_mesh():
    hlo = sampler._decode.lower(
        sampler.graphdef, params, cache, logits, jnp.ones(8, bool), jnp.full(8, 4, jnp.int32),
        sampler.stop_ids, jax.random.key(0), GREEDY, None, window=64, max_new=4,
        pad_id=0).compile().as_text()
  sizes = [collectives._result_bytes(m["shape"], m["op"], bool(m["start"]))
           for m in collectives._LINE.finditer(hlo) if m["op"] == "all-gather"]
  return max(sizes, default=0)


def test_a_serving_layouts_decode_step_gathers_no_layer_weights_the_fsdp_one_does(meshes):
  train, serve = meshes
  policy = _trained_policy(train)
  master = nnx.state(policy, nnx.Param)
  layer_weight = CONFIG.hidden_size * CONFIG.intermediate_size * 2  # one layer's w_up in bf16
  fsdp = _largest_all_gather(_sampler(policy, train), master)
  serving = _largest_all_gather(_sampler(policy, serve),
                                DecodeCopy(master, serve, jnp.bfloat16).refresh(master))
  assert fsdp >= layer_weight > serving, (fsdp, layer_weight, serving)


def test_refreshing_the_decode_copy_after_an_update_compiles_nothing_new(meshes):
  train, serve = meshes
  policy = _trained_policy(train)
  copier = DecodeCopy(nnx.state(policy, nnx.Param), serve, jnp.bfloat16)
  sampler = _sampler(policy, serve)
  update = jax.jit(lambda s: jax.tree.map(lambda a: a * 0.99, s), donate_argnums=0)
  counter = CompileCounter()
  state = nnx.state(policy, nnx.Param)
  before, cache = None, sampler.init_cache(8)  # allocated once, as the rollouts keep theirs
  for step in range(3):
    with jax.set_mesh(train):
      state = update(state)
      copy = copier.refresh(state)
    cache, logits = sampler.prefill(copy, cache, _rows(0))
    cache = sampler.decode(copy, cache, logits, rng=jax.random.key(step), max_new_tokens=4,
                           sampling=GREEDY).cache
    if step == 0:  # everything compiled once
      before = counter.count
  assert counter.count == before
  # Every weight moves between the layouts but the norm scales, replicated in both.
  moved = [v[...] for path, v in nnx.to_flat_state(copy) if not str(path[-1]).endswith("norm")]
  assert len(moved) == len(jax.tree.leaves(copy)) - 3
  assert copier.bytes == sum(a.size * 2 for a in moved)  # bf16
