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
New keys/values are written differently per layout too (`CacheView.scan_layers`), so the model never
sees the layout: it runs its layers through a `CacheView` (the `models.qwen2.LayerCache` protocol).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlver_jax.models.presets import Qwen2Config
from rlver_jax.parallel.sharding import DEFAULT_RULES, ShardingRules, global_array

Layout = Literal["heads_major", "slots_major"]
LAYOUTS = ("heads_major", "slots_major")
KV_AXES = {"heads_major": ("layers", "batch", "kv_heads", "cache_seq", "head_dim"),
           "slots_major": ("layers", "batch", "cache_seq", "kv_heads", "head_dim")}
LENGTH_AXES = ("batch",)
# One decoder layer as a cache scan runs it: (hidden, layer params, k window, v window [B, K, W, Dh])
# -> (hidden, the new tokens' (k, v) [B, K, T, Dh]).
LayerFn = Callable[[jax.Array, dict, jax.Array, jax.Array], tuple[jax.Array, tuple[jax.Array, jax.Array]]]


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

  def advanced(self, num_new_B: jax.Array) -> "KVCache":
    """The cache after num_new_B [B] more tokens per row were written (on device, traced)."""
    return dataclasses.replace(self, lengths=self.lengths + num_new_B)

  def take_rows(self, source_B: jax.Array) -> "KVCache":
    """Row b becomes a copy of row source_B[b]: its slots and length (batch is axis 1 of k/v)."""
    return KVCache(jnp.take(self.k, source_B, axis=1), jnp.take(self.v, source_B, axis=1),
                   self.lengths[source_B], self.layout)

  def view(self, window: int) -> "CacheView":
    """This cache as one cached forward pass sees it, attending to its first `window` slots."""
    return CacheView(self, window)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheView:
  """A KVCache read through a window of its first `window` (static) slots, for one cached forward
  pass of T new tokens per row that land at slots lengths..lengths+T-1 (their RoPE positions).

  Implements `models.qwen2.LayerCache`: the model asks which window slots are filled and hands its
  decoder layer to `scan_layers`, which reads each layer's window and writes the new keys/values
  in whichever way suits the layout.
  """
  cache: KVCache
  window: int = dataclasses.field(metadata=dict(static=True))

  def filled(self, num_new: int) -> jax.Array:
    """[B, T, W] True where a window slot holds one of the row's cached tokens (for every new token)."""
    old = jnp.arange(self.window)[None, None, :] < self.cache.lengths[:, None, None]
    return jnp.broadcast_to(old, (self.cache.batch_size, num_new, self.window))

  def _layer_window(self, c: jax.Array, l: jax.Array) -> jax.Array:
    """Layer l's first `window` slots of c as [B, K, W, Dh], sliced inside the scan body."""
    if self.cache.layout == "slots_major":
      L, B, _, K, Dh = c.shape
      return jax.lax.dynamic_slice(c, (l, 0, 0, 0, 0), (1, B, self.window, K, Dh))[0].transpose(0, 2, 1, 3)
    L, B, K, _, Dh = c.shape
    return jax.lax.dynamic_slice(c, (l, 0, 0, 0, 0), (1, B, K, self.window, Dh))[0]

  def scan_layers(self, layer: LayerFn, x: jax.Array, layer_params: dict) -> tuple[jax.Array, KVCache]:
    """Runs `layer` over the L stacked layers (`lax.scan`), each attending to its own window.

    Returns (hidden, the cache with the new keys/values written, in place on donated buffers; its
    lengths unchanged). Writes past the preallocated end (padding) are dropped.
    Where the writes go differs by backend, like the layout. TPU (slots-major): each layer writes its
    own slab inside the scan; one scatter of all layers after the scan made XLA:TPU lay the cache out
    with layers next to head dim and copy it around the decode loop (72B simulator decode on a 1x4x2
    mesh: 33 -> 11.8 GiB of temporaries per chip). XLA:CPU copies a scan-carried cache every layer
    (4x slower decode), so there the scan only reads the cache and one scatter writes all layers after.
    """
    c = self.cache
    slot = c.lengths[:, None] + jnp.arange(x.shape[1])[None, :]  # [B, T] where each token lands
    rows = jnp.arange(x.shape[0])[:, None]
    layers = jnp.arange(c.k.shape[0])
    if c.layout == "slots_major":
      def write(kv, l, new):  # new [B, K, T, Dh] -> layer l at `slot`
        return kv.at[l, rows, slot].set(new.transpose(0, 2, 1, 3).astype(kv.dtype), mode="drop")

      def body_writing(carry, p_l):
        h, ck, cv = carry
        p, l = p_l
        h, (k, v) = layer(h, p, self._layer_window(ck, l), self._layer_window(cv, l))
        return (h, write(ck, l, k), write(cv, l, v)), None

      (x, k, v), _ = jax.lax.scan(body_writing, (x, c.k, c.v), (layer_params, layers))
      return x, dataclasses.replace(c, k=k, v=v)

    def body_reading(h, p_l):
      p, l = p_l
      return layer(h, p, self._layer_window(c.k, l), self._layer_window(c.v, l))

    x, (new_k, new_v) = jax.lax.scan(body_reading, x, (layer_params, layers))
    # new_k/v [L, B, K, T, Dh]; with a slice between the advanced indices (B, T) the updates are
    # [B, T, L, K, Dh].
    write_all = lambda kv, new: kv.at[:, rows, :, slot].set(new.transpose(1, 3, 0, 2, 4).astype(kv.dtype),
                                                            mode="drop")
    return x, dataclasses.replace(c, k=write_all(c.k, new_k), v=write_all(c.v, new_v))
