"""The weights a trained model decodes with: cast to the compute dtype, in its rollout layout.

Training keeps fp32 master weights in the training layout (FSDP); decode wants bf16 weights split
over heads and MLP (`spec/layouts.py`). `DecodeCopy.refresh` makes that copy from the training state
after each update in one on-device transfer: the cast runs first, in the training layout, so the
reshard moves half the bytes, and nothing passes through the host. With equal layouts it is the cast
alone, which still takes the per-step fp32 -> bf16 cast out of every decode step.

Norm scales stay fp32: the model reads them in fp32 (`qwen2.rms_norm`), and every other weight is
cast to the compute dtype before use, so decoding from the copy gives the same tokens as decoding
from the master weights.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from rlver_jax.models.factory import state_shardings
from rlver_jax.parallel.sharding import DEFAULT_RULES, ShardingRules


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def decode_dtype(var: nnx.Variable, compute_dtype) -> jnp.dtype:
  """The dtype a weight has in the decode copy: the compute dtype, except fp32 norm scales and
  non-float leaves."""
  axes = var.get_metadata().get("logical_axes", ())
  if "norm" in axes or not jnp.issubdtype(var.dtype, jnp.floating):
    return var.dtype
  return jnp.dtype(compute_dtype)


def cast_for_decode(state: nnx.State, compute_dtype) -> nnx.State:
  """The state with each weight at its `decode_dtype` (traceable; no resharding)."""
  return jax.tree.map(lambda v: v.replace(v[...].astype(decode_dtype(v, compute_dtype))), state,
                      is_leaf=_is_var)


class DecodeCopy:
  """Refreshes a decode copy of `state`-shaped weights on `mesh` (the rollout layout)."""

  def __init__(self, abstract_state: nnx.State, mesh: Mesh, compute_dtype,
               rules: ShardingRules = DEFAULT_RULES):
    self.compute_dtype = jnp.dtype(compute_dtype)
    self.mesh = mesh
    self.shardings = state_shardings(abstract_state, mesh, rules)
    self._cast = jax.jit(lambda s: cast_for_decode(s, self.compute_dtype))
    self.seconds = 0.0  # of the last refresh
    self.bytes = 0      # moved between layouts by the last refresh (0: equal layouts)

  def refresh(self, state: nnx.State) -> nnx.State:
    """The decode copy of `state` (left as it is), placed in the rollout layout's shardings."""
    t0 = time.perf_counter()
    cast = self._cast(state)
    moved = [a for a, s in zip(jax.tree.leaves(cast), jax.tree.leaves(self.shardings))
             if not a.sharding.is_equivalent_to(s, a.ndim)]
    self.bytes = sum(a.size * a.dtype.itemsize for a in moved)
    # The cast is a temporary of this call: donated, the transfer may reuse its buffers.
    out = jax.device_put(cast, self.shardings, donate=True) if moved else cast
    jax.block_until_ready(out)
    self.seconds = time.perf_counter() - t0
    return out

  def metrics(self) -> dict[str, float]:
    return {"time/reshard": self.seconds, "reshard/bytes": float(self.bytes)}
