"""Models born sharded: abstract shapes first, then shardings from the rules, then a jitted init.

No parameter ever exists in full on one device or on the host unless the mesh itself says so.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from rlver_jax.models.presets import Qwen2Config
from rlver_jax.models.qwen2 import Head, Qwen2, RematPolicy
from rlver_jax.sharding import DEFAULT_RULES, ShardingRules


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def abstract_model(config: Qwen2Config, *, head: Head = "lm", param_dtype=jnp.float32,
                   dtype=jnp.bfloat16, remat: RematPolicy = "none") -> Qwen2:
  """The model with ShapeDtypeStruct leaves (nothing allocated)."""
  return nnx.eval_shape(lambda: Qwen2(config, rngs=nnx.Rngs(0), head=head, param_dtype=param_dtype,
                                      dtype=dtype, remat=remat))


def state_shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> nnx.State:
  """A State of the same structure whose leaves are NamedShardings derived from `logical_axes`."""
  def one(v: nnx.Variable):
    axes = v.get_metadata().get("logical_axes", (None,) * len(v.shape))
    return v.replace(rules.sharding(mesh, axes, v.shape))
  return jax.tree.map(one, state, is_leaf=_is_var)


def create_model(config: Qwen2Config, *, mesh: Mesh | None = None, rules: ShardingRules = DEFAULT_RULES,
                 seed: int = 0, head: Head = "lm", param_dtype=jnp.float32, dtype=jnp.bfloat16,
                 remat: RematPolicy = "none", init_std: float = 0.02) -> Qwen2:
  """Randomly initialised model whose params are created directly in their target shardings."""
  def init():
    model = Qwen2(config, rngs=nnx.Rngs(seed), head=head, param_dtype=param_dtype, dtype=dtype,
                  remat=remat, init_std=init_std)
    return nnx.state(model)

  graphdef, abstract_state = nnx.split(abstract_model(config, head=head, param_dtype=param_dtype,
                                                      dtype=dtype, remat=remat))
  if mesh is None:
    return nnx.merge(graphdef, jax.jit(init)())
  shardings = state_shardings(abstract_state, mesh, rules)
  state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def param_shardings_by_path(model: Qwen2) -> dict[str, jax.sharding.Sharding]:
  """{"layers.wq": sharding, ...} of a concrete model (for tests and reports)."""
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    out[".".join(str(p) for p in path)] = var[...].sharding
  return out
