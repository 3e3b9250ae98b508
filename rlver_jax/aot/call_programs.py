"""One call of each program of a training step, at a chosen shape, for the step-time model.

Unlike `aot.programs` (the largest shapes, for the memory plan), these fix what a call's cost depends
on: the layer count (the model compiles at 3 and 4 layers and the cost is extrapolated, see
`aot.step_time`), an append's token bucket T and attended window W, a decode's window W, and an update
or scoring micro-batch's rows x length. Each builder returns `(jitted_fn, abstract_args)` like a
registered program. The cache layout is the target's (TPU slots-major unless told).

Shape legend: B rows, T tokens, V vocabulary, W attended window.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh

from rlver_jax.aot import programs as ap
from rlver_jax.aot import target as aot_target
from rlver_jax.spec.forward import ModelShape
from rlver_jax.rl.batch import UpdateBatch
from rlver_jax.rl.update import token_logprobs_and_entropy
from rlver_jax.sampling.draft_rule import draw, token_logprobs
from rlver_jax.sampling.speculative import last_logits, verify_pass
from rlver_jax.sampling.strategies import SamplingParams
from rlver_jax.spec import RunSpec


@dataclasses.dataclass(frozen=True)
class SamplerShape:
  """A sampler program's static shape: the model, cache rows and slots, its layout."""
  model: ModelShape   # as `aot.programs.policy_model` / `simulator_model` give it
  rows: int
  max_len: int
  max_new: int
  layout: str = ap.TPU_CACHE_LAYOUT


def layers_preset(preset: str, layers: int) -> str:
  """The preset "NAME" (or "NAME:L") as "NAME:layers": the same widths at another depth."""
  return f"{preset.partition(':')[0]}:{layers}"


def with_layers(model: ModelShape, layers: int) -> ModelShape:
  """`model` with `layers` layers of the same widths."""
  return dataclasses.replace(model, preset=layers_preset(model.preset, layers))


def append_call(shape: SamplerShape, tokens: int, window: int, mesh: Mesh):
  """`Sampler.append` of one chunk of `tokens` (a bucket) per row after a cache read through `window`."""
  sampler, params, cache = ap.sampler_inputs(shape.model, shape.rows, shape.max_len, mesh, shape.layout)
  V = ap.model_config(shape.model).vocab_size
  args = (params, cache, ap.abstract_array((shape.rows, tokens), jnp.int32, ("batch", "seq"), mesh),
          ap.abstract_array((shape.rows,), jnp.int32, ("batch",), mesh),
          ap.abstract_array((shape.rows, V), jnp.float32, ("batch", "act_vocab"), mesh))
  return ap.Bound(sampler._append, (sampler.graphdef,), dict(window=window)), args


def decode_call(shape: SamplerShape, window: int, mesh: Mesh):
  """`Sampler.decode` at `window`: its loop body (one token per row) is what XLA's cost counts once.

  The weights and the cache take the layouts the compiler picks (`_auto_layouts`): the compiled
  loop converts them once, before it starts, so a step pays no conversion. In their stored layouts
  each traced step would pay it (the 72B on v5p-64: 287 MB a layer against a 219 MB shard)."""
  sampler, params, cache = ap.sampler_inputs(shape.model, shape.rows, shape.max_len, mesh, shape.layout)
  V = ap.model_config(shape.model).vocab_size
  row = lambda dtype: ap.abstract_array((shape.rows,), dtype, ("batch",), mesh)
  args = (params, cache, ap.abstract_array((shape.rows, V), jnp.float32, ("batch", "act_vocab"), mesh),
          row(jnp.bool_), row(jnp.int32),
          *ap._replicated(mesh, (sampler.stop_ids, jax.random.key(0), SamplingParams.make())))
  static = dict(window=window, max_new=shape.max_new, pad_id=sampler.pad_id)
  return _auto_layouts(ap.Bound(sampler._decode, (sampler.graphdef,), static), args, cache, mesh), args


def _verify_fn(graphdef, params, cache, fed_BxK1, q_logp_BxKxV, key, sampling, *, window):
  """A verify pass as `sampling.speculative`'s loop runs it: the k + 1 positions through the cached
  model, log-probs at each under the sampling filter, the acceptance rule, the raw log-probs' norm."""
  written, logits, _, n, y = verify_pass(nnx.merge(graphdef, params), cache, fed_BxK1,
                                         q_logp_BxKxV, key, sampling, window)
  return written.advanced(n + 1), n, y, jax.nn.logsumexp(logits, axis=-1)


def _draft_step_fn(graphdef, params, cache, inp_Bx2, num_B, key, sampling, *, window):
  """One draft step: its input (the backlog, or the last proposal) through the cached draft, then a
  proposal drawn from its sampling distribution."""
  logits, written = last_logits(nnx.merge(graphdef, params), cache, inp_Bx2, num_B, window)
  q = token_logprobs(logits, sampling)
  return written, draw(key, q), q


def verify_call(shape: SamplerShape, draft_tokens: int, window: int, mesh: Mesh):
  """One verify pass of `draft_tokens` + 1 positions a row at `window` (the simulator's side of a
  draft-and-verify decode), weights and cache in the compiler's layouts as in `decode_call`."""
  sampler, params, cache = ap.sampler_inputs(shape.model, shape.rows, shape.max_len, mesh, shape.layout)
  V, B, k = ap.model_config(shape.model).vocab_size, shape.rows, draft_tokens
  args = (params, cache, ap.abstract_array((B, k + 1), jnp.int32, ("batch", "seq"), mesh),
          ap.abstract_array((B, k, V), jnp.float32, ("batch", None, "act_vocab"), mesh),
          *ap._replicated(mesh, (jax.random.key(0), SamplingParams.make())))
  bound = ap.Bound(_verify_fn, (sampler.graphdef,), dict(window=window))
  return _auto_layouts(bound, args, cache, mesh), args


def draft_step_call(shape: SamplerShape, window: int, mesh: Mesh):
  """One draft step at `window` (two input positions a row: the loop's fixed width)."""
  sampler, params, cache = ap.sampler_inputs(shape.model, shape.rows, shape.max_len, mesh, shape.layout)
  row = lambda dtype, *more: ap.abstract_array((shape.rows, *more), dtype,
                                               ("batch", "seq")[:1 + len(more)], mesh)
  args = (params, cache, row(jnp.int32, 2), row(jnp.int32),
          *ap._replicated(mesh, (jax.random.key(0), SamplingParams.make())))
  bound = ap.Bound(_draft_step_fn, (sampler.graphdef,), dict(window=window))
  return _auto_layouts(bound, args, cache, mesh), args


def _auto_layouts(bound: ap.Bound, args, cache, mesh: Mesh):
  """`bound` as a jit whose weights (`args[0]`) and cache arrays (k, v and an int8 cache's scales:
  matched by shape) have compiler-chosen layouts: one step of a loop that converts them once,
  before it starts."""
  big = {a.shape for a in (cache.k, cache.v, cache.k_scale, cache.v_scale) if a is not None}
  fn = lambda *a: bound.fn(*bound.head, *a, **bound.static)
  auto = lambda x: Format(Layout.AUTO, x.sharding)
  pick = lambda x: auto(x) if x.shape in big else x.sharding
  with jax.set_mesh(mesh):
    out = jax.eval_shape(fn, *args)
  ins = (jax.tree.map(auto, args[0]), *jax.tree.map(pick, args[1:]))
  return jax.jit(fn, in_shardings=ins, out_shardings=jax.tree.map(pick, out), donate_argnums=(1,))


def _policy_layers(spec: RunSpec, layers: int) -> RunSpec:
  return aot_target.with_policy(spec, preset=layers_preset(spec.policy.preset, layers))


def update_call(spec: RunSpec, mesh: Mesh, *, rows: int, length: int, critic: bool, layers: int):
  """`Updater`'s step on one micro-batch of `rows` x `length` (one gradient + one optimizer update)."""
  spec = _policy_layers(spec, layers)
  fn, (params, opt_state, _) = ap.update_program(spec, mesh, critic=critic)
  batch = UpdateBatch.abstract((1, rows, length), mesh,
                               ref_logp=spec.rl.kl_coef > 0 and not spec.rl.kl_in_reward,
                               values=spec.algo == "ppo")
  return fn, (params, opt_state, batch)


def forward_call(spec: RunSpec, mesh: Mesh, *, rows: int, length: int, layers: int):
  """The scoring pass of one micro-batch (old / reference log-probs), as the trainer runs it."""
  spec = _policy_layers(spec, layers)
  model = ap.policy_model(spec)
  graphdef, params = ap.abstract_params(model, mesh)
  chunk = spec.rl.logits_chunk
  tokens = ap.abstract_array((rows, length), jnp.int32, ("batch", "seq"), mesh)

  @jax.jit
  def logprobs(params, tokens, segments):
    return token_logprobs_and_entropy(nnx.merge(graphdef, params), tokens, segments, chunk)[0]

  return logprobs, (params, tokens, tokens)


def reshard_call(spec: RunSpec, train: Mesh, decode: Mesh, *, layers: int):
  """`aot.programs.reshard_program` on a policy of `layers` layers."""
  return ap.reshard_program(_policy_layers(spec, layers), train, decode)
