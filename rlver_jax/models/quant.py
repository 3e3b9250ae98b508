"""Symmetric int8 for a frozen model: weights with a scale per output channel, KV with a scale per
token and KV head.

A quantized value is `q * scale` with q in [-127, 127] int8 and scale = max |x| / 127 over the axes
the scale spans (the weight's input axes; a key/value's head dim). -128 is never used, so the range
is symmetric. Scales are fp32: the matmul accumulates in fp32 and the scale multiplies that
accumulator, which is free and keeps the channel's scale out of the compute dtype's rounding.

Shape legend: B rows, K key/value heads, T tokens, Dh head dim.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_F32 = jnp.float32
FORMATS = ("bf16", "int8")  # config values: 'bf16' = unquantized, in the model's own dtype
SCALE_SUFFIX = "_scale"

# The input (contracted) logical axes of each quantized weight; its scale spans the other axes. The
# embedding's rows are its output channels when tied to the LM head, and one scale per row also
# serves the lookup.
INPUT_AXES = {
    "embed": ("embed",),
    "lm_head": ("embed",),
    "layers.wq": ("embed",),
    "layers.wk": ("embed",),
    "layers.wv": ("embed",),
    "layers.wo": ("q_heads", "head_dim"),
    "layers.w_gate": ("embed",),
    "layers.w_up": ("embed",),
    "layers.w_down": ("mlp",),
}


def input_dims(path: str, logical_axes: tuple[str, ...]) -> tuple[int, ...]:
  return tuple(i for i, a in enumerate(logical_axes) if a in INPUT_AXES[path])


def scale_axes(path: str, logical_axes: tuple[str, ...]) -> tuple[str, ...]:
  """The scale's logical axes: the weight's without its input axes (so it shards like the outputs)."""
  return tuple(a for a in logical_axes if a not in INPUT_AXES[path])


def quantize(x: jax.Array, dims: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """(int8 q, fp32 scale) with x ~= q * scale; the scale is reduced over `dims` (dropped from its shape).
  An all-zero slice gets scale 0 (and q 0), so it dequantizes to exactly 0."""
  x = x.astype(_F32)
  scale = jnp.max(jnp.abs(x), axis=dims) / 127.0
  safe = jnp.expand_dims(jnp.where(scale > 0, scale, 1.0), dims)
  q = jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8)
  return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dims: tuple[int, ...]) -> jax.Array:
  return q.astype(_F32) * jnp.expand_dims(scale, dims)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
  """Keys or values in int8: `values` [B, K, T, Dh] and `scale` [B, K, T] (one per token and head).

  Attention never dequantizes them whole: a key's scale multiplies its score, a value's its
  probability, and the matmuls read the int8 values converted to the compute dtype (exact: |q| <= 127).
  """
  values: jax.Array
  scale: jax.Array

  @staticmethod
  def of(x: jax.Array) -> "QuantizedKV":
    q, scale = quantize(x, (x.ndim - 1,))
    return QuantizedKV(q, scale)

  def dequantized(self) -> jax.Array:
    return dequantize(self.values, self.scale, (self.values.ndim - 1,))
