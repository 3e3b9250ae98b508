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

An int8 cache (dtype int8: a frozen simulator's) holds k/v as int8 with fp32 scales k_scale/v_scale
[L, B, K, S] or [L, B, S, K], one per token and KV head (`models.quant.QuantizedKV`): half the bytes
of bf16 plus 4 per token and head. Layers read their window as `QuantizedKV` and attention applies
the scales; rewinds, row copies and the layouts work on the scales as on k/v.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlver_jax.models.presets import Qwen2Config
from rlver_jax.models.quant import QuantizedKV
from rlver_jax.parallel.sharding import DEFAULT_RULES, ShardingRules, global_array

Layout = Literal["heads_major", "slots_major"]
LAYOUTS = ("heads_major", "slots_major")
KV_AXES = {"heads_major": ("layers", "batch", "kv_heads", "cache_seq", "head_dim"),
           "slots_major": ("layers", "batch", "cache_seq", "kv_heads", "head_dim")}
SCALE_AXES = {layout: tuple(a for a in axes if a != "head_dim") for layout, axes in KV_AXES.items()}
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
  k_scale: jax.Array | None = None  # int8 caches only
  v_scale: jax.Array | None = None

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.k.shape[KV_AXES[self.layout].index("cache_seq")]

  @property
  def int8(self) -> bool:
    return self.k_scale is not None

  def bytes(self) -> int:
    scales = 0 if self.k_scale is None else 2 * self.k_scale.size * 4
    return 2 * self.k.size * self.k.dtype.itemsize + scales + self.lengths.size * 4

  @staticmethod
  def shapes(config: Qwen2Config, batch: int, max_len: int, dtype,
             layout: Layout = "heads_major") -> "KVCache":
    if layout not in LAYOUTS:
      raise ValueError(f"unknown KV cache layout {layout!r}; expected one of {LAYOUTS}")
    size = {"layers": config.num_layers, "batch": batch, "kv_heads": config.num_kv_heads,
            "cache_seq": max_len, "head_dim": config.head_dim}
    kv = jax.ShapeDtypeStruct(tuple(size[a] for a in KV_AXES[layout]), dtype)
    scale = None
    if jnp.dtype(dtype) == jnp.int8:
      scale = jax.ShapeDtypeStruct(tuple(size[a] for a in SCALE_AXES[layout]), jnp.float32)
    return KVCache(k=kv, v=kv, lengths=jax.ShapeDtypeStruct((batch,), jnp.int32), layout=layout,
                   k_scale=scale, v_scale=scale)

  @staticmethod
  def shardings(config: Qwen2Config, batch: int, max_len: int, dtype, mesh: Mesh,
                rules: ShardingRules = DEFAULT_RULES, layout: Layout = "heads_major") -> "KVCache":
    s = KVCache.shapes(config, batch, max_len, dtype, layout)
    kv = rules.sharding(mesh, KV_AXES[layout], s.k.shape)
    scale = None if s.k_scale is None else rules.sharding(mesh, SCALE_AXES[layout], s.k_scale.shape)
    return KVCache(k=kv, v=kv, lengths=rules.sharding(mesh, LENGTH_AXES, (batch,)), layout=layout,
                   k_scale=scale, v_scale=scale)

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

  def arrays(self) -> tuple[jax.Array, ...]:
    """(k, v), and (k_scale, v_scale) after them in an int8 cache."""
    return (self.k, self.v) + ((self.k_scale, self.v_scale) if self.int8 else ())

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    """Same slots, new fill lengths: a rewind (drop a row's tail) or a reset (zeros) costs nothing."""
    lengths = np.asarray(lengths, np.int32)
    return dataclasses.replace(self, lengths=global_array(lengths, self.lengths.sharding))

  def advanced(self, num_new_B: jax.Array) -> "KVCache":
    """The cache after num_new_B [B] more tokens per row were written (on device, traced)."""
    return dataclasses.replace(self, lengths=self.lengths + num_new_B)

  def take_rows(self, source_B: jax.Array) -> "KVCache":
    """Row b becomes a copy of row source_B[b]: its slots and length (batch is axis 1 of k/v and
    of the scales)."""
    rows = lambda a: None if a is None else jnp.take(a, source_B, axis=1)
    return KVCache(rows(self.k), rows(self.v), self.lengths[source_B], self.layout,
                   rows(self.k_scale), rows(self.v_scale))

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
    """Layer l's first `window` slots of c as [B, K, W, Dh] (a scale: [B, K, W]), sliced inside
    the scan body."""
    if self.cache.layout == "slots_major":
      size = (1, c.shape[1], self.window) + c.shape[3:]
      w = jax.lax.dynamic_slice(c, (l,) + (0,) * (c.ndim - 1), size)[0]
      # One kv head a chip (the TPU serving layouts): a bitcast, the dots read the cache in place.
      return w.transpose((0, 2, 1, 3) if c.ndim == 5 else (0, 2, 1))
    size = c.shape[1:3] + (self.window,) + c.shape[4:]
    return jax.lax.dynamic_slice(c, (l,) + (0,) * (c.ndim - 1), (1,) + size)[0]

  def layer_windows(self, l: jax.Array):
    """Layer l's (keys, values) window: [B, K, W, Dh] arrays, or `QuantizedKV` of an int8 cache."""
    return self._windows(self.cache.arrays(), l)

  def _windows(self, arrays: tuple[jax.Array, ...], l: jax.Array):
    """`layer_windows` of the cache arrays (k, v[, k_scale, v_scale]) `arrays`."""
    if len(arrays) == 2:
      return tuple(self._layer_window(a, l) for a in arrays)
    return tuple(QuantizedKV(self._layer_window(a, l), self._layer_window(s, l))
                 for a, s in zip(arrays[:2], arrays[2:]))

  def scan_layers(self, layer: LayerFn, x: jax.Array, layer_params: dict) -> tuple[jax.Array, KVCache]:
    """Runs `layer` over the L stacked layers (`lax.scan`), each attending to its own window.

    Returns (hidden, the cache with the new keys/values written, in place on donated buffers; its
    lengths unchanged). Writes past the preallocated end (padding) are dropped.
    Where the writes go differs by backend, like the layout. TPU (slots-major): each layer writes its
    own slab inside the scan; one scatter of all layers after the scan made XLA:TPU lay the cache out
    with layers next to head dim and copy it around the decode loop (72B simulator decode on a 1x4x2
    mesh: 33 -> 11.8 GiB of temporaries per chip). XLA:CPU copies a scan-carried cache every layer
    (4x slower decode), so there the scan only reads the cache and one scatter writes all layers after.
    An int8 cache writes each new token's int8 values and scale (the layer's `QuantizedKV`, or
    its float keys/values quantized here).
    """
    c = self.cache
    slot = c.lengths[:, None] + jnp.arange(x.shape[1])[None, :]  # [B, T] where each token lands
    rows = jnp.arange(x.shape[0])[:, None]
    layers = jnp.arange(c.k.shape[0])
    # The cache's arrays and the new tokens' as parallel tuples (an int8 cache adds its scales).
    stored = c.arrays()

    def parts(new_k, new_v):
      if not c.int8:
        return new_k, new_v
      k, v = (n if isinstance(n, QuantizedKV) else QuantizedKV.of(n) for n in (new_k, new_v))
      return k.values, v.values, k.scale, v.scale

    def swap(a, axes):  # a token's (K, Dh) values or (K,) scale moved after its slot
      return a.transpose(axes if a.ndim == len(axes) else axes[:-1])

    cached = lambda arrays: dataclasses.replace(c, **dict(zip(("k", "v", "k_scale", "v_scale"), arrays)))
    window = self._windows

    if c.layout == "slots_major":
      def write(kv, l, new):  # new [B, K, T, Dh] (a scale: [B, K, T]) -> layer l at `slot`
        return kv.at[l, rows, slot].set(swap(new, (0, 2, 1, 3)).astype(kv.dtype), mode="drop")

      def body_writing(carry, p_l):
        h, arrays = carry
        p, l = p_l
        h, new = layer(h, p, *window(arrays, l))
        return (h, tuple(write(a, l, n) for a, n in zip(arrays, parts(*new)))), None

      (x, arrays), _ = jax.lax.scan(body_writing, (x, stored), (layer_params, layers))
      return x, cached(arrays)

    def body_reading(h, p_l):
      p, l = p_l
      h, new = layer(h, p, *window(stored, l))
      return h, parts(*new)

    x, new = jax.lax.scan(body_reading, x, (layer_params, layers))
    # new k/v [L, B, K, T, Dh]; with a slice between the advanced indices (B, T) the updates are
    # [B, T, L, K, Dh] (scales [L, B, K, T] -> [B, T, L, K]).
    write_all = lambda kv, n: kv.at[:, rows, :, slot].set(swap(n, (1, 3, 0, 2, 4)).astype(kv.dtype),
                                                          mode="drop")
    return x, cached(tuple(write_all(a, n) for a, n in zip(stored, new)))
