"""Programs that `rlver_jax.aot` compiles ahead of time, and the abstract inputs they need.

A program is a function `(target, mesh) -> (jitted_fn, abstract_args)`: it reads its own settings
of the typed target (`aot.target`: a run's `RunSpec`, or `ForwardSpec`), builds a `jax.jit`-wrapped
function and a tuple of ShapeDtypeStruct pytrees (sharded on `mesh`) such that
`jitted_fn.lower(*abstract_args)` lowers it. Nothing is allocated. A new program is one function
plus one entry in `PROGRAMS`; an aot config names the programs it wants in `config.programs`.

`forward` reads an aot config's `ForwardSpec` (`configs/aot_forward.py`). The run programs (sampler
and update steps) read a training run's `RunSpec` (`configs/grpo_think.py`, ...) and compile the
trainer's own jitted functions: `Sampler`'s append/decode and `Updater`'s step. Run programs take their resident state (params and KV
cache, or params and optimizer state) as their first two arguments; `rlver_jax.aot.plan` relies on it.

Shape legend: B batch, T tokens, V vocabulary, S cache slots, M micro-batches.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlver_jax.aot.target import Target
from rlver_jax.spec.forward import ForwardSpec, ModelShape
from rlver_jax.spec import RunSpec
from rlver_jax.models.factory import abstract_model, state_shardings
from rlver_jax.models.presets import Qwen2Config, get_preset, param_dtype_of
from rlver_jax.models.qwen2 import Head, Qwen2
from rlver_jax.parallel.sharding import DEFAULT_RULES, ShardingRules, batch_shards, padded_batch
from rlver_jax.rl.batch import BatchLayout, UpdateBatch
from rlver_jax.rl.update import Updater, make_optimizer, opt_state_shardings
from rlver_jax.sampling.kv_cache import KVCache, default_layout
from rlver_jax.sampling.sampler import DEFAULT_APPEND_BUCKETS, Sampler, bucket
from rlver_jax.sampling.strategies import SamplingParams

Program = Callable[[Target, Mesh], tuple[Callable[..., Any], tuple[Any, ...]]]

# A typical turn appended to a dialogue (a user reply plus headers), in tokens.
TYPICAL_TURN_TOKENS = 256


def model_config(model: ModelShape) -> Qwen2Config:
  """The architecture named by `model.preset`; "NAME:L" or `model.num_layers` gives it L layers."""
  name, _, layers = model.preset.partition(":")
  config = get_preset(name)
  num_layers = int(layers) if layers else model.num_layers
  if num_layers is not None:
    config = dataclasses.replace(config, num_layers=num_layers)
  return config


def abstract_array(shape: Sequence[int], dtype, logical_axes: Sequence[str | None], mesh: Mesh,
                   rules: ShardingRules = DEFAULT_RULES) -> jax.ShapeDtypeStruct:
  """An input placeholder sharded by the logical-axis rules."""
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=rules.sharding(mesh, logical_axes, shape))


def _module(model: ModelShape, head: Head = "lm") -> Qwen2:
  return abstract_model(model_config(model), head=head, param_dtype=param_dtype_of(model.param_dtype),
                        dtype=param_dtype_of(model.dtype), remat=model.remat,
                        int8_weights=model.weight_dtype == "int8")


def cache_dtype(model: ModelShape):
  """The KV cache's dtype of a model description: int8 when `kv_dtype` says so, else its compute dtype."""
  return jnp.int8 if model.kv_dtype == "int8" else param_dtype_of(model.dtype)


def _with_shardings(tree, shardings):
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings)


def abstract_params(model: ModelShape, mesh: Mesh, *, head: Head = "lm",
                    rules: ShardingRules = DEFAULT_RULES) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, state) of the model described by `model`; state leaves are sharded ShapeDtypeStructs."""
  graphdef, state = nnx.split(_module(model, head))
  return graphdef, _with_shardings(state, state_shardings(state, mesh, rules))


def forward(spec: ForwardSpec, mesh: Mesh):
  """Full-sequence forward: (params, input_ids [B, T]) -> fp32 logits [B, T, V]."""
  graphdef, state = abstract_params(spec.model, mesh)
  B, T = spec.batch_size, spec.seq_len
  input_ids = abstract_array((B, T), jnp.int32, ("batch", "seq"), mesh)

  @jax.jit
  def run(state, input_ids):
    return nnx.merge(graphdef, state)(input_ids)

  return run, (state, input_ids)


# -- sampler programs: a model + a batch of dialogues + a cache length -------------------------------


@dataclasses.dataclass(frozen=True)
class Bound:
  """A jitted function with its leading static argument and static keywords fixed."""
  fn: Any
  head: tuple[Any, ...]
  static: dict[str, Any]

  def lower(self, *args):
    return self.fn.lower(*self.head, *args, **self.static)


def _replicated(mesh: Mesh, tree):
  """Placeholders like the leaves of `tree` (arrays or ShapeDtypeStructs), whole on every device."""
  whole = NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole), tree)


# The programs are compiled for TPU while this process's backend is the CPU: name the layout.
TPU_CACHE_LAYOUT = default_layout("tpu")


def abstract_cache(config: Qwen2Config, batch: int, max_len: int, dtype, mesh: Mesh,
                   layout=TPU_CACHE_LAYOUT) -> KVCache:
  """The sampler's KV cache as sharded ShapeDtypeStructs, in the TPU layout unless told."""
  return _with_shardings(KVCache.shapes(config, batch, max_len, dtype, layout),
                         KVCache.shardings(config, batch, max_len, dtype, mesh, layout=layout))


def sampler_inputs(model: ModelShape, batch: int, max_len: int, mesh: Mesh,
                   layout=TPU_CACHE_LAYOUT):
  """(sampler, params, cache): the trainer's Sampler on the abstract model, with sharded inputs."""
  module = _module(model)
  config = model_config(model)
  stop_ids = config.eos_token_id if isinstance(config.eos_token_id, tuple) else (0,)
  buckets = model.append_buckets or DEFAULT_APPEND_BUCKETS
  sampler = Sampler(module, max_len=max_len, stop_ids=stop_ids, pad_id=config.pad_token_id or 0,
                    append_buckets=buckets, mesh=mesh, cache_layout=layout,
                    cache_dtype=cache_dtype(model))
  _, params = abstract_params(model, mesh)
  return sampler, params, abstract_cache(config, batch, max_len, sampler.cache_dtype, mesh, layout)


def append_program(model: ModelShape, batch: int, max_len: int, tokens: int,
                   mesh: Mesh):
  """`Sampler.append` of `tokens` per row (bucketed, at most one chunk), attending the full window."""
  sampler, params, cache = sampler_inputs(model, batch, max_len, mesh)
  T = bucket(min(tokens, max_len, sampler.append_buckets[-1]), sampler.append_buckets)
  V = model_config(model).vocab_size
  args = (params, cache, abstract_array((batch, T), jnp.int32, ("batch", "seq"), mesh),
          abstract_array((batch,), jnp.int32, ("batch",), mesh),
          abstract_array((batch, V), jnp.float32, ("batch", "act_vocab"), mesh))
  return Bound(sampler._append, (sampler.graphdef,), dict(window=sampler.windows[-1])), args


def prefill_program(model: ModelShape, batch: int, max_len: int, mesh: Mesh):
  """The largest append chunk (the prefill's, or a long turn's late in a dialogue) at the full window.

  A prefill onto an empty cache attends a small window; the same chunk appended to a nearly full
  cache attends all of it. Compiling the latter bounds both. (`append_program` caps the chunk at
  the largest append bucket.)
  """
  return append_program(model, batch, max_len, max_len, mesh)


def decode_program(model: ModelShape, batch: int, max_len: int, max_new: int,
                   mesh: Mesh):
  """`Sampler.decode` of up to `max_new` tokens per row, attending the full cache window."""
  sampler, params, cache = sampler_inputs(model, batch, max_len, mesh)
  V = model_config(model).vocab_size
  row = lambda dtype: abstract_array((batch,), dtype, ("batch",), mesh)
  args = (params, cache, abstract_array((batch, V), jnp.float32, ("batch", "act_vocab"), mesh),
          row(jnp.bool_), row(jnp.int32),
          *_replicated(mesh, (sampler.stop_ids, jax.random.key(0), SamplingParams.make())))
  static = dict(window=sampler.windows[-1], max_new=max_new, pad_id=sampler.pad_id)
  return Bound(sampler._decode, (sampler.graphdef,), static), args


# -- the run's models and batch, read from a training run's spec ---------------------------------------


def policy_model(spec: RunSpec) -> ModelShape:
  """The policy (and critic) as the AOT tool describes a model: fp32 master params, bf16 compute."""
  p = spec.policy
  return ModelShape(preset=p.preset, param_dtype=p.param_dtype, dtype=p.compute_dtype,
                    remat=p.remat, append_buckets=tuple(p.append_buckets))


def policy_decode_model(spec: RunSpec) -> ModelShape:
  """The policy as its rollout reads it: in a serving layout a copy in the compute dtype
  (`reshard_program`); with `rollout.policy_mesh='train'` the fp32 training params themselves."""
  model = policy_model(spec)
  if spec.rollout.policy_mesh != "train":
    model = dataclasses.replace(model, param_dtype=spec.policy.compute_dtype)
  return model


def simulator_model(spec: RunSpec) -> ModelShape:
  """The co-located simulator: frozen, params and compute in `simulator.dtype` (its linear weights and
  KV cache in int8 if `simulator.weight_dtype` / `kv_dtype` say so), no remat."""
  s = spec.simulator
  return ModelShape(preset=s.preset, param_dtype=s.dtype, dtype=s.dtype, remat="none",
                    append_buckets=tuple(s.append_buckets), weight_dtype=s.weight_dtype,
                    kv_dtype=s.kv_dtype)


def num_dialogues(spec: RunSpec) -> int:
  return spec.rl.profiles_per_step * spec.rl.group_size


def num_samples(spec: RunSpec) -> int:
  """Training rows per step, at most: one per policy turn when thoughts are dropped, else per dialogue."""
  per_dialogue = spec.simulator.max_turns if spec.policy.think and not spec.policy.keep_thoughts else 1
  return num_dialogues(spec) * per_dialogue


def micro_batch_rows(spec: RunSpec, mesh: Mesh | None = None) -> int:
  """Global rows of one micro-batch: `rl.micro_batch_size` per batch shard (as `Trainer.make_batch`)."""
  return spec.rl.micro_batch_size * (1 if mesh is None else batch_shards(mesh))


def batch_layout(spec: RunSpec, mesh: Mesh | None = None) -> BatchLayout:
  """The largest batch a step can make: the most samples, each a full context (the trainer lays
  out its real batch with the same `BatchLayout.for_step`); packed rows longer than that
  (rl.pack_length) at that length (packed, a step has no more rows nor larger micro-batches)."""
  layout = BatchLayout.for_step(num_samples(spec), spec.policy.max_context,
                                micro_batch_rows(spec, mesh),
                                mini_batch_rows=spec.rl.rows_per_mini_batch,
                                mini_batches=spec.rl.mini_batches,
                                shards=1 if mesh is None else batch_shards(mesh))
  return layout._replace(length=max(layout.length, spec.rl.update_pack_length or 0))


def mini_batches(spec: RunSpec) -> int:
  """Optimizer updates per epoch at the most samples a step can have."""
  return batch_layout(spec).mini_batches


def micro_batches(spec: RunSpec, mesh: Mesh | None = None) -> int:
  """M of one update step: the packed rows over micro- and mini-batches."""
  return batch_layout(spec, mesh).update_shape[0]


def packed_length(spec: RunSpec) -> int:
  """The longest packed training length (a full context up to its bucket)."""
  return batch_layout(spec).length


def lent_rows(spec: RunSpec) -> int:
  """Dialogues holding a cache row at once: `rollout.rows` (continuous batching), 0 = all of them."""
  rows = spec.rollout.rows
  return min(rows, num_dialogues(spec)) if rows else num_dialogues(spec)


def rollout_rows(spec: RunSpec, mesh: Mesh | None = None) -> int:
  """KV-cache rows of a training rollout: `lent_rows`, padded to the batch shards like
  `Sampler.padded_rows`."""
  return padded_batch(lent_rows(spec), mesh)


def _sampler_role(spec: RunSpec, role: str, mesh: Mesh | None = None):
  section = spec.policy if role == "policy" else spec.simulator
  model = policy_decode_model(spec) if role == "policy" else simulator_model(spec)
  return model, rollout_rows(spec, mesh), section.max_context, section.max_new_tokens


def run_prefill(spec: RunSpec, mesh: Mesh, *, role: str):
  model, batch, max_len, _ = _sampler_role(spec, role, mesh)
  return prefill_program(model, batch, max_len, mesh)


def run_append(spec: RunSpec, mesh: Mesh, *, role: str):
  model, batch, max_len, _ = _sampler_role(spec, role, mesh)
  return append_program(model, batch, max_len, TYPICAL_TURN_TOKENS, mesh)


def run_decode(spec: RunSpec, mesh: Mesh, *, role: str):
  model, batch, max_len, max_new = _sampler_role(spec, role, mesh)
  return decode_program(model, batch, max_len, max_new, mesh)


# -- update programs ---------------------------------------------------------------------------------


def abstract_opt_state(optimizer: optax.GradientTransformation, params, mesh: Mesh):
  """Optimizer state shaped by `optimizer.init`; param-like leaves take the params' shardings."""
  state = jax.eval_shape(optimizer.init, params)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state,
                      opt_state_shardings(optimizer, params, mesh))


def abstract_batch(spec: RunSpec, mesh: Mesh | None = None) -> UpdateBatch:
  """One mini-batch of the largest step as `Updater`'s jitted step receives it."""
  return UpdateBatch.abstract(batch_layout(spec, mesh).update_shape, mesh,
                              ref_logp=spec.rl.kl_coef > 0 and not spec.rl.kl_in_reward,
                              values=spec.algo == "ppo")


def batch_keys(spec: RunSpec) -> tuple[str, ...]:
  """The arrays of the update's batch, in `UpdateBatch`'s field order."""
  return tuple(abstract_batch(spec).arrays())


def update_program(spec: RunSpec, mesh: Mesh, *, critic: bool):
  """`Updater`'s jitted step: (params, optimizer state, batch) -> (params, state, metrics), donated."""
  head: Head = "value" if critic else "lm"
  model = policy_model(spec)
  optimizer = make_optimizer(spec.optim.optim_config(critic=critic))
  updater = Updater(_module(model, head), optimizer, "value" if critic else "policy",
                    spec.loss_config())
  _, params = abstract_params(model, mesh, head=head)
  return updater._step, (params, abstract_opt_state(optimizer, params, mesh),
                         abstract_batch(spec, mesh))


def reshard_program(spec: RunSpec, train: Mesh, decode: Mesh):
  """The policy's decode copy refreshed after an update: (training params on `train`, the old copy,
  donated) -> the params cast to the compute dtype on the training mesh, then moved to `decode`'s
  layout; one program, so its transfer is in the HLO like any collective."""
  _, params = abstract_params(policy_model(spec), train)
  _, old = abstract_params(policy_decode_model(spec), decode)
  dtype = param_dtype_of(spec.policy.compute_dtype)
  at_train = jax.tree.map(lambda x: x.sharding, params)

  @functools.partial(jax.jit, out_shardings=jax.tree.map(lambda x: x.sharding, old),
                     donate_argnums=1)
  def reshard(params, old):
    del old  # its buffers take the new copy
    # Cast where the params live, so the transfer moves compute-dtype bytes (the barrier keeps
    # XLA from moving the cast after the transfer).
    return jax.lax.optimization_barrier(jax.tree.map(
        lambda p, s: jax.lax.with_sharding_constraint(p.astype(dtype), s), params, at_train))

  return reshard, (params, old)


PROGRAMS: dict[str, Program] = {
    "forward": forward,
    "policy_prefill": functools.partial(run_prefill, role="policy"),
    "policy_append": functools.partial(run_append, role="policy"),
    "policy_decode": functools.partial(run_decode, role="policy"),
    "simulator_prefill": functools.partial(run_prefill, role="simulator"),
    "simulator_append": functools.partial(run_append, role="simulator"),
    "simulator_decode": functools.partial(run_decode, role="simulator"),
    "grpo_update": functools.partial(update_program, critic=False),
    "ppo_policy_update": functools.partial(update_program, critic=False),
    "ppo_critic_update": functools.partial(update_program, critic=True),
}
