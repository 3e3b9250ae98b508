"""The preallocated, sharded KV cache: an explicit pytree that every sampler step takes and returns.

Shapes: k/v [L, B, K, S, Dh] (layers, rows, KV heads, slots, head dim); lengths [B] = filled slots per
row. A row's tokens occupy slots 0..lengths-1 in order, so the slot index is also the RoPE position.
Slots sit next to head dim so that a layer's window [B, K, W, Dh] is the batched-GEMM operand that
attention reads directly, with no per-step transpose.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlver_jax.models.presets import Qwen2Config
from rlver_jax.sharding import DEFAULT_RULES, ShardingRules, global_array

KV_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
LENGTH_AXES = ("batch",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.k.shape[3]

  def bytes(self) -> int:
    return 2 * self.k.size * self.k.dtype.itemsize + self.lengths.size * 4

  @staticmethod
  def shapes(config: Qwen2Config, batch: int, max_len: int, dtype) -> "KVCache":
    kv = jax.ShapeDtypeStruct((config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim),
                              dtype)
    return KVCache(k=kv, v=kv, lengths=jax.ShapeDtypeStruct((batch,), jnp.int32))

  @staticmethod
  def shardings(config: Qwen2Config, batch: int, max_len: int, dtype, mesh: Mesh,
                rules: ShardingRules = DEFAULT_RULES) -> "KVCache":
    s = KVCache.shapes(config, batch, max_len, dtype)
    kv = rules.sharding(mesh, KV_AXES, s.k.shape)
    return KVCache(k=kv, v=kv, lengths=rules.sharding(mesh, LENGTH_AXES, (batch,)))

  @staticmethod
  def allocate(config: Qwen2Config, batch: int, max_len: int, dtype=jnp.bfloat16,
               mesh: Mesh | None = None, rules: ShardingRules = DEFAULT_RULES) -> "KVCache":
    """An empty cache, created directly in its sharding (never whole on one device)."""
    shapes = KVCache.shapes(config, batch, max_len, dtype)

    def zeros():
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    if mesh is None:  # committed to one device, like every later step's output: no recompile
      device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      out = jax.tree.map(lambda _: device, shapes)
    else:
      out = KVCache.shardings(config, batch, max_len, dtype, mesh, rules)
    return jax.jit(zeros, out_shardings=out)()

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    """Same slots, new fill lengths: a rewind (drop a row's tail) or a reset (zeros) costs nothing."""
    lengths = np.asarray(lengths, np.int32)
    return dataclasses.replace(self, lengths=global_array(lengths, self.lengths.sharding))
