"""Models born sharded: abstract shapes first, then shardings from the rules, then a jitted init.

No parameter ever exists in full on one device or on the host unless the mesh itself says so.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from rlver_jax.models.presets import Qwen2Config
from rlver_jax.models.qwen2 import Head, Qwen2, RematPolicy
from rlver_jax.parallel.sharding import DEFAULT_RULES, ShardingRules


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def abstract_model(config: Qwen2Config, *, head: Head = "lm", param_dtype=jnp.float32,
                   dtype=jnp.bfloat16, remat: RematPolicy = "none", int8_weights: bool = False) -> Qwen2:
  """The model with ShapeDtypeStruct leaves (nothing allocated)."""
  return nnx.eval_shape(lambda: Qwen2(config, rngs=nnx.Rngs(0), head=head, param_dtype=param_dtype,
                                      dtype=dtype, remat=remat, int8_weights=int8_weights))


def state_shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> nnx.State:
  """A State of the same structure whose leaves are NamedShardings derived from `logical_axes`.

  Logs a warning when the mesh does not divide a dimension its rule shards (e.g. Qwen2.5-7B's 28
  query heads on tensor=8): those weights are replicated over that axis, costing memory on every
  chip and repeating their matmuls.
  """
  dropped = {}

  def one(v: nnx.Variable):
    axes = v.get_metadata().get("logical_axes", (None,) * len(v.shape))
    for name, size, ax in rules.dropped(axes, v.shape, mesh):
      dropped.setdefault((name, size, ax), []).append(v)
    return v.replace(rules.sharding(mesh, axes, v.shape))
  out = jax.tree.map(one, state, is_leaf=_is_var)
  for (name, size, ax), vs in sorted(dropped.items()):
    _warn_once(f"{ax}={mesh.shape[ax]} does not divide {name} ({size}): {len(vs)} param(s) "
               f"({sum(math.prod(v.shape) for v in vs) / 1e6:.1f}M values) replicated over {ax}; "
               f"a config.mesh.{ax} that divides {size} would shard them")
  return out


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:  # policy, critic and simulator often share one shape
  if message not in _WARNED:
    _WARNED.add(message)
    logging.warning("sharding: %s", message)


def create_model(config: Qwen2Config, *, mesh: Mesh | None = None, rules: ShardingRules = DEFAULT_RULES,
                 seed: int = 0, head: Head = "lm", param_dtype=jnp.float32, dtype=jnp.bfloat16,
                 remat: RematPolicy = "none", init_std: float = 0.02,
                 int8_weights: bool = False) -> Qwen2:
  """Randomly initialised model whose params are created directly in their target shardings
  (with `int8_weights`, the same random weights quantized, inside the same jitted init)."""
  def init():
    model = Qwen2(config, rngs=nnx.Rngs(seed), head=head, param_dtype=param_dtype, dtype=dtype,
                  remat=remat, init_std=init_std, int8_weights=int8_weights)
    return nnx.state(model)

  graphdef, abstract_state = nnx.split(abstract_model(config, head=head, param_dtype=param_dtype,
                                                      dtype=dtype, remat=remat,
                                                      int8_weights=int8_weights))
  if mesh is None:
    return nnx.merge(graphdef, jax.jit(init)())
  shardings = state_shardings(abstract_state, mesh, rules)
  state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)

