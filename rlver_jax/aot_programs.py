"""Programs that `rlver_jax.aot` compiles ahead of time, and the abstract inputs they need.

A program is a function `(config, mesh) -> (jitted_fn, abstract_args)`: it reads its own section of
the ConfigDict, builds a `jax.jit`-wrapped function and a tuple of ShapeDtypeStruct pytrees (sharded on
`mesh`) such that `jitted_fn.lower(*abstract_args)` lowers it. Nothing is allocated. A new program is one
function plus one entry in `PROGRAMS`; a config names the programs it wants in `config.programs`.

Shape legend: B batch, T tokens, V vocabulary.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from rlver_jax.models.factory import abstract_model, state_shardings
from rlver_jax.models.presets import Qwen2Config, get_preset, param_dtype_of
from rlver_jax.models.qwen2 import Head
from rlver_jax.sharding import DEFAULT_RULES, ShardingRules

Program = Callable[[ml_collections.ConfigDict, Mesh], tuple[Callable[..., Any], tuple[Any, ...]]]


def model_config(model: ml_collections.ConfigDict) -> Qwen2Config:
  """The architecture named by `model.preset`, with `model.num_layers` overriding the depth if set."""
  config = get_preset(model.preset)
  if model.num_layers is not None:
    config = dataclasses.replace(config, num_layers=model.num_layers)
  return config


def abstract_array(shape: Sequence[int], dtype, logical_axes: Sequence[str | None], mesh: Mesh,
                   rules: ShardingRules = DEFAULT_RULES) -> jax.ShapeDtypeStruct:
  """An input placeholder sharded by the logical-axis rules."""
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=rules.sharding(mesh, logical_axes, shape))


def abstract_params(model: ml_collections.ConfigDict, mesh: Mesh, *, head: Head = "lm",
                    rules: ShardingRules = DEFAULT_RULES) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, state) of the model described by `model`; state leaves are sharded ShapeDtypeStructs."""
  abstract = abstract_model(model_config(model), head=head,
                            param_dtype=param_dtype_of(model.param_dtype),
                            dtype=param_dtype_of(model.dtype), remat=model.remat)
  graphdef, state = nnx.split(abstract)
  shardings = state_shardings(state, mesh, rules)
  state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                       state, shardings)
  return graphdef, state


def forward(config: ml_collections.ConfigDict, mesh: Mesh):
  """Full-sequence forward: (params, input_ids [B, T]) -> fp32 logits [B, T, V]."""
  graphdef, state = abstract_params(config.model, mesh)
  B, T = config.forward.batch_size, config.forward.seq_len
  input_ids = abstract_array((B, T), jnp.int32, ("batch", "seq"), mesh)

  @jax.jit
  def run(state, input_ids):
    return nnx.merge(graphdef, state)(input_ids)

  return run, (state, input_ids)


PROGRAMS: dict[str, Program] = {
    "forward": forward,
}
