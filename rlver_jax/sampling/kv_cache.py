"""The preallocated, sharded KV cache: an explicit pytree that every sampler step takes and returns.

Shapes: k/v [L, B, K, S, Dh] ("heads_major") or [L, B, S, K, Dh] ("slots_major"): layers, rows, KV
heads, slots, head dim; lengths [B] = filled slots per row. A row's tokens occupy slots
0..lengths-1 in order, so the slot index is also the RoPE position.

The layout is per backend. On TPU a token's (K, Dh) slab is one (8, 128) tile when slots are major,
so the per-step write is tile-aligned; XLA:TPU re-lays a heads-major cache that way by itself, at the
cost of copying the whole cache in and out of every decode loop (measured: 72B simulator decode
temporaries 3.3 -> 26 GiB per v5p chip). On CPU (and GPU) heads-major makes a layer's window
[B, K, W, Dh] the batched-GEMM operand that attention reads directly; slots-major transposes the window
every step (measured on this 2-core CPU at a 2k window: 267 vs 199 ms per SmolLM2 decode step).
The model also writes new keys/values differently per layout (`Qwen2._run_layers`).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlver_jax.models.presets import Qwen2Config
from rlver_jax.sharding import DEFAULT_RULES, ShardingRules, global_array

Layout = Literal["heads_major", "slots_major"]
LAYOUTS = ("heads_major", "slots_major")
KV_AXES = {"heads_major": ("layers", "batch", "kv_heads", "cache_seq", "head_dim"),
           "slots_major": ("layers", "batch", "cache_seq", "kv_heads", "head_dim")}
LENGTH_AXES = ("batch",)


def default_layout(platform: str | None = None) -> Layout:
  """slots_major on TPU, heads_major elsewhere (see the module docstring)."""
  return "slots_major" if (platform or jax.default_backend()) == "tpu" else "heads_major"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  layout: Layout = dataclasses.field(default="heads_major", metadata=dict(static=True))

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.k.shape[KV_AXES[self.layout].index("cache_seq")]

  def bytes(self) -> int:
    return 2 * self.k.size * self.k.dtype.itemsize + self.lengths.size * 4

  @staticmethod
  def shapes(config: Qwen2Config, batch: int, max_len: int, dtype,
             layout: Layout = "heads_major") -> "KVCache":
    if layout not in LAYOUTS:
      raise ValueError(f"unknown KV cache layout {layout!r}; expected one of {LAYOUTS}")
    size = {"layers": config.num_layers, "batch": batch, "kv_heads": config.num_kv_heads,
            "cache_seq": max_len, "head_dim": config.head_dim}
    kv = jax.ShapeDtypeStruct(tuple(size[a] for a in KV_AXES[layout]), dtype)
    return KVCache(k=kv, v=kv, lengths=jax.ShapeDtypeStruct((batch,), jnp.int32), layout=layout)

  @staticmethod
  def shardings(config: Qwen2Config, batch: int, max_len: int, dtype, mesh: Mesh,
                rules: ShardingRules = DEFAULT_RULES, layout: Layout = "heads_major") -> "KVCache":
    s = KVCache.shapes(config, batch, max_len, dtype, layout)
    kv = rules.sharding(mesh, KV_AXES[layout], s.k.shape)
    return KVCache(k=kv, v=kv, lengths=rules.sharding(mesh, LENGTH_AXES, (batch,)), layout=layout)

  @staticmethod
  def allocate(config: Qwen2Config, batch: int, max_len: int, dtype=jnp.bfloat16,
               mesh: Mesh | None = None, rules: ShardingRules = DEFAULT_RULES,
               layout: Layout = "heads_major") -> "KVCache":
    """An empty cache, created directly in its sharding (never whole on one device)."""
    shapes = KVCache.shapes(config, batch, max_len, dtype, layout)

    def zeros():
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    if mesh is None:  # committed to one device, like every later step's output: no recompile
      device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      out = jax.tree.map(lambda _: device, shapes)
    else:
      out = KVCache.shardings(config, batch, max_len, dtype, mesh, rules, layout)
    return jax.jit(zeros, out_shardings=out)()

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    """Same slots, new fill lengths: a rewind (drop a row's tail) or a reset (zeros) costs nothing."""
    lengths = np.asarray(lengths, np.int32)
    return dataclasses.replace(self, lengths=global_array(lengths, self.lengths.sharding))
