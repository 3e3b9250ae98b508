"""The Qwen2 family (Qwen2 / Qwen2.5, and Llama-architecture checkpoints such as SmolLM2) in Flax NNX.

Shape legend: B batch, T new tokens, S cache slots, W attended window (W <= S), D hidden, H query heads,
K key/value heads, G = H / K, Dh head dim, F MLP width, V vocabulary, L layers.

Every weight is described once in `param_specs` (shape, logical axes, initializer); the module, the
sharded init and the checkpoint loader all derive from that table. Layers are stacked along a leading
L axis and run with `lax.scan`, so compile time does not grow with depth.

Numerics: norms, RoPE, softmax and everything after the LM head run in fp32 (bf16 loses too much
precision in variance sums, rotation angles and log-probs); matmuls run in `dtype` with fp32 accumulation.
A frozen model may hold its linear weights in int8 (`int8_weights`, `models/quant.py`): each weight
`w` then has a `w_scale` per output channel, applied to the fp32 accumulator.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from rlver_jax.models import quant
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.models.quant import QuantizedKV
from rlver_jax.parallel.sharding import constrain

RematPolicy = Literal["none", "full", "dots"]
Head = Literal["lm", "value"]
_F32 = jnp.float32
# Query rows per attention block (see `attention`).
Q_BLOCK = 512
_MASKED = -1e30  # finite, so a fully masked (padding) query row gives a uniform row, not NaN


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  shape: tuple[int, ...]
  logical_axes: tuple[str, ...]
  init: Literal["normal", "zeros", "ones"]


def param_specs(config: Qwen2Config, head: Head = "lm") -> dict[str, ParamSpec]:
  """One entry per weight. Keys are attribute paths ("layers.wq"); stacked weights lead with L."""
  c = config
  L, D, H, K, Dh, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                          c.intermediate_size, c.vocab_size)
  specs = {
      "embed": ParamSpec((V, D), ("vocab", "embed"), "normal"),
      "layers.attn_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
      "layers.wq": ParamSpec((L, D, H, Dh), ("layers", "embed", "q_heads", "head_dim"), "normal"),
      "layers.wk": ParamSpec((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
      "layers.wv": ParamSpec((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
      "layers.wo": ParamSpec((L, H, Dh, D), ("layers", "q_heads", "head_dim", "embed"), "normal"),
      "layers.mlp_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
      "layers.w_gate": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
      "layers.w_up": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
      "layers.w_down": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal"),
      "final_norm": ParamSpec((D,), ("norm",), "ones"),
  }
  if c.qkv_bias:
    specs["layers.bq"] = ParamSpec((L, H, Dh), ("layers", "q_heads", "head_dim"), "zeros")
    specs["layers.bk"] = ParamSpec((L, K, Dh), ("layers", "kv_heads", "head_dim"), "zeros")
    specs["layers.bv"] = ParamSpec((L, K, Dh), ("layers", "kv_heads", "head_dim"), "zeros")
  if head == "lm" and not c.tie_word_embeddings:
    specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), "normal")
  if head == "value":
    specs["value_head"] = ParamSpec((D,), ("embed",), "zeros")
    specs["value_bias"] = ParamSpec((), (), "zeros")
  return specs


def _init_value(spec: ParamSpec, key: jax.Array, dtype, std: float) -> jax.Array:
  if spec.init == "ones":
    return jnp.ones(spec.shape, dtype)
  if spec.init == "zeros":
    return jnp.zeros(spec.shape, dtype)
  return (std * jax.random.normal(key, spec.shape, _F32)).astype(dtype)


class _Stacked(nnx.Module):
  """Holds the L-stacked per-layer weights."""


class Qwen2(nnx.Module):
  """Decoder-only Qwen2-family transformer with an LM head (policy) or a scalar value head (critic).

  `model(input_ids)` returns logits [B, T, V] (fp32) for positions 0..T-1 with a causal mask. Padding:
  pass `segment_ids` (0 = padding; tokens attend only within their own segment), positions default to
  the count of real tokens before each token, so left- and right-padded rows give the same logits.
  """

  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs, head: Head = "lm",
               param_dtype=jnp.float32, dtype=jnp.bfloat16, remat: RematPolicy = "none",
               init_std: float = 0.02, int8_weights: bool = False):
    self.config = config
    self.head = head
    self.dtype = dtype
    self.remat = remat
    self.int8_weights = int8_weights
    self.layers = _Stacked()
    for path, spec in param_specs(config, head).items():
      owner, name = (self.layers, path.split(".")[1]) if path.startswith("layers.") else (self, path)
      value = _init_value(spec, rngs.params(), param_dtype, init_std)
      if int8_weights and path in quant.INPUT_AXES:
        value, scale = quant.quantize(value, quant.input_dims(path, spec.logical_axes))
        setattr(owner, name + quant.SCALE_SUFFIX,
                nnx.Param(scale, logical_axes=quant.scale_axes(path, spec.logical_axes)))
      setattr(owner, name, nnx.Param(value, logical_axes=spec.logical_axes))

  # -- public entry points -------------------------------------------------------------------------

  def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    hidden = self.hidden_states(input_ids, positions, segment_ids)
    return self.logits(hidden) if self.head == "lm" else self.values(hidden)

  def hidden_states(self, input_ids, positions=None, segment_ids=None) -> jax.Array:
    """Final-norm hidden states [B, T, D] of a full (uncached) forward pass."""
    B, T = input_ids.shape
    if segment_ids is None:
      segment_ids = jnp.ones((B, T), jnp.int32)
    if positions is None:
      positions = default_positions(segment_ids)
    idx = jnp.arange(T)
    causal = idx[None, :, None] >= idx[None, None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = causal & same & (segment_ids[:, None, :] != 0)
    x = self._embed(input_ids)
    x, _ = self._run_layers(x, positions, BlockMask.over_tokens(mask), cache=None)
    return rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)

  def cached_hidden_states(self, input_ids, positions, cache: LayerCache, own_mask=None):
    """Runs T new tokens per row after each row's cached tokens; returns (hidden, updated cache).

    input_ids/positions [B, T] (rows right-padded; padded tokens land past the row's new length and
    are never attended by real tokens). Each layer attends to the cache's window (its first W slots,
    `sampling/kv_cache.py`'s `CacheView`) and to the new tokens as two key segments with one
    softmax, so its cost follows the filled length, not S, and the cache is never concatenated with
    the new tokens. The returned cache has the new keys/values written; the caller advances lengths.
    `own_mask` [B, T, T] replaces the causal mask among the new tokens (a tree of continuations).
    """
    T = input_ids.shape[1]
    old = cache.filled(T)
    if own_mask is None:
      own_mask = jnp.arange(T)[None, :, None] >= jnp.arange(T)[None, None, :]  # [1, T, T] causal
    mask = BlockMask.over_cache_and_tokens(old, jnp.broadcast_to(own_mask, old.shape[:1] + (T, T)))
    x = self._embed(input_ids)
    x, cache = self._run_layers(x, positions, mask, cache)
    return rms_norm(x, self.final_norm[...], self.config.rms_norm_eps), cache

  def logits(self, hidden: jax.Array) -> jax.Array:
    """LM head: [..., D] -> fp32 logits [..., V]."""
    name = "embed" if self.config.tie_word_embeddings else "lm_head"
    w = self.embed[...].T if name == "embed" else self.lm_head[...]
    out = jnp.einsum("...d,dv->...v", hidden.astype(self.dtype), w.astype(self.dtype),
                     preferred_element_type=_F32)
    if self.int8_weights:
      out = out * getattr(self, name + quant.SCALE_SUFFIX)[...]  # [V], per vocabulary row
    return constrain(out, ("batch",) + ("seq",) * (out.ndim - 2) + ("act_vocab",))

  def values(self, hidden: jax.Array) -> jax.Array:
    """Value head: [..., D] -> fp32 scalar values [...]."""
    return hidden.astype(_F32) @ self.value_head[...].astype(_F32) + self.value_bias[...].astype(_F32)

  # -- internals -----------------------------------------------------------------------------------

  def _embed(self, input_ids):
    x = jnp.take(self.embed[...], input_ids, axis=0)
    if self.int8_weights:
      x = x.astype(_F32) * jnp.take(self.embed_scale[...], input_ids, axis=0)[..., None]
    x = x.astype(self.dtype)
    return constrain(x, ("batch", "seq", "act_embed"))

  def _run_layers(self, x, positions, mask: BlockMask, cache: LayerCache | None):
    c = self.config
    layer_params = {k: v[...] for k, v in vars(self.layers).items() if isinstance(v, nnx.Param)}
    cos, sin = rope_tables(positions, c.head_dim, c.rope_theta)
    block = functools.partial(_block, config=c, dtype=self.dtype)
    if self.remat != "none":
      policy = None if self.remat == "full" else jax.checkpoint_policies.dots_with_no_batch_dims_saveable
      block = jax.checkpoint(block, policy=policy)

    if cache is None:
      def body(h, p):
        h, _ = block(h, p, cos, sin, mask, None)
        return h, None
      x, _ = jax.lax.scan(body, x, layer_params)
      return x, None
    # The cache decides how its windows are read and its writes placed (its layout's business).
    return cache.scan_layers(lambda h, p, k, v: block(h, p, cos, sin, mask, (k, v)), x, layer_params)


def default_positions(segment_ids: jax.Array) -> jax.Array:
  """0-based index of each token among the real tokens of its row (padding gets 0)."""
  real = (segment_ids != 0).astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(real, axis=-1) - 1, 0)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(_F32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * weight.astype(_F32)).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float):
  """cos/sin [B, T, Dh/2] in fp32 (angles reach ~1e5 rad; bf16 would scramble them)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=_F32) / head_dim))
  angles = positions.astype(_F32)[..., None] * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate-half RoPE (the Hugging Face Qwen2/Llama convention) on x [B, T, N, Dh]."""
  x32 = x.astype(_F32)
  half = x.shape[-1] // 2
  x1, x2 = x32[..., :half], x32[..., half:]
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _proj(x, p, name: str, dtype, spec: str):
  """x times weight p[name]; an int8 weight's scale (its output dims, the einsum's trailing ones)
  multiplies the fp32 accumulator."""
  out = jnp.einsum(spec, x, p[name].astype(dtype), preferred_element_type=_F32)
  scale = p.get(name + quant.SCALE_SUFFIX)
  return (out if scale is None else out * scale).astype(dtype)


def _block(x, p, cos, sin, mask: BlockMask, window_kv, *, config: Qwen2Config, dtype):
  """One decoder layer. Without a cache (window_kv None): attention over the new tokens only.

  With one (this layer's (k, v) window [B, K, W, Dh]) attention runs over the window and the new
  tokens, and the new tokens' (k, v) [B, K, T, Dh] are returned for the cache to write. An int8
  window (`QuantizedKV`) makes the new tokens int8 too, before they are attended: every token is
  then seen as the cache holds it, so an append equals a re-prefill however the tokens were chunked.
  """
  c = config
  h = rms_norm(x, p["attn_norm"], c.rms_norm_eps)
  q = _proj(h, p, "wq", dtype, "btd,dhk->bthk")
  k = _proj(h, p, "wk", dtype, "btd,dhk->bthk")
  v = _proj(h, p, "wv", dtype, "btd,dhk->bthk")
  if c.qkv_bias:
    q, k, v = q + p["bq"].astype(dtype), k + p["bk"].astype(dtype), v + p["bv"].astype(dtype)
  q = constrain(apply_rope(q, cos, sin), ("batch", "seq", "act_heads", None))
  k = constrain(apply_rope(k, cos, sin), ("batch", "seq", "act_kv_heads", None))
  v = constrain(v, ("batch", "seq", "act_kv_heads", None))
  own_kv = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))  # [B, K, T, Dh], the segments' layout
  window = None
  if window_kv is not None and isinstance(window_kv[0], QuantizedKV):
    window, own_kv = window_kv, tuple(QuantizedKV.of(a) for a in own_kv)
  elif window_kv is not None:
    window = tuple(a.astype(dtype) for a in window_kv)
  attn = segment_attention(q, mask.segments(window, own_kv))
  x = x + _proj(attn, p, "wo", dtype, "bthk,hkd->btd")
  x = constrain(x, ("batch", "seq", "act_embed"))
  h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
  gate = _proj(h, p, "w_gate", dtype, "btd,df->btf")
  up = _proj(h, p, "w_up", dtype, "btd,df->btf")
  act = constrain(jax.nn.silu(gate.astype(_F32)).astype(dtype) * up, ("batch", "seq", "act_mlp"))
  x = x + _proj(act, p, "w_down", dtype, "btf,fd->btd")
  return constrain(x, ("batch", "seq", "act_embed")), (None if window_kv is None else own_kv)


# keys, values [B, K, S, Dh] (arrays, or int8 `QuantizedKV`); mask [B, T, S]
Segment = tuple[Any, Any, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
  """Which keys each of a block's T query tokens may see: its own tokens (`own` [B, T, T]) and,
  in a cached pass, the cache window's slots before them (`window` [B, T, W]; None uncached)."""
  own: jax.Array
  window: jax.Array | None = None

  @staticmethod
  def over_tokens(own: jax.Array) -> "BlockMask":
    return BlockMask(own)

  @staticmethod
  def over_cache_and_tokens(window: jax.Array, own: jax.Array) -> "BlockMask":
    return BlockMask(own, window)

  def segments(self, window_kv, own_kv) -> tuple[Segment, ...]:
    """The key segments for `segment_attention`: the window's (k, v) first when cached, then own."""
    own = (own_kv[0], own_kv[1], self.own)
    if self.window is None:
      return (own,)
    return ((window_kv[0], window_kv[1], self.window), own)


class LayerCache(Protocol):
  """What a cached forward pass needs of a KV cache; `sampling/kv_cache.py`'s `CacheView` is one.

  The cache owns its layout: it says which of its window slots are filled and runs the layer scan,
  handing each layer its window and writing the new tokens' keys/values where its layout wants them.
  """

  def filled(self, num_new: int) -> jax.Array:
    """[B, T, W] True where a window slot is filled."""

  def scan_layers(self, layer, x: jax.Array, layer_params: dict) -> tuple[jax.Array, Any]:
    """`layer(h, p, k_window, v_window) -> (h, (k_new, v_new))` over the stacked layers; returns
    (hidden, the cache with the new keys/values written)."""


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              q_block: int = Q_BLOCK) -> jax.Array:
  """Grouped-query attention. q [B, T, H, Dh], k/v [B, S, K, Dh], mask [B, T, S] -> [B, T, H, Dh]."""
  return segment_attention(q, ((k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask),), q_block)


def segment_attention(q: jax.Array, segments: tuple[Segment, ...], q_block: int = Q_BLOCK) -> jax.Array:
  """Attention of q [B, T, H, Dh] over the union of key segments, with one softmax across them.

  Segments (e.g. a cached window and the new tokens) are never concatenated: each gets its own
  score matmul and the softmax is combined from their maxima and sums, so decoding does not copy
  the cache every step. Queries go in blocks of `q_block` (a `lax.map` whose body is
  rematerialised), so scores and their gradients take [B, H, q_block, S] at a time instead of
  [B, H, T, S]: for an 8k-token training row of a 7B model that is 1.8 GiB per 4 rows instead of
  28 GiB. Shorter inputs take one block.
  """
  B, T, H, Dh = q.shape
  if T <= q_block:
    return _attend(q, segments)
  n = -(-T // q_block)
  pad = n * q_block - T  # padded query rows see nothing (uniform probs) and are cut off below
  q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  blocked = lambda a: a.reshape((B, n, q_block) + a.shape[2:]).swapaxes(0, 1)
  masks = tuple(blocked(jnp.pad(m, ((0, 0), (0, pad), (0, 0)))) for _, _, m in segments)

  def one_block(qm):  # the segments' keys/values whole, their masks cut to this query block
    qb, mb = qm
    return _attend(qb, tuple((k, v, m) for (k, v, _), m in zip(segments, mb)))

  out = jax.lax.map(jax.checkpoint(one_block), (blocked(q), masks))  # [n, B, q_block, H, Dh]
  return out.swapaxes(0, 1).reshape(B, n * q_block, H, Dh)[:, :T]


def _attend(q: jax.Array, segments: tuple[Segment, ...]) -> jax.Array:
  """`segment_attention` in one query block.

  Both products are plain batched matmuls over leading (B, K) with the G query heads of a KV head
  folded into the rows: XLA:CPU runs that layout as a library GEMM, where batch dims in the middle
  (the einsum written directly on [B, T, K, G, Dh]) fell back to a loop nest ~2.7x slower at 1k tokens.
  """
  B, T, H, Dh = q.shape
  K = _operand(segments[0][0], q.dtype)[0].shape[1]
  G = H // K
  qg = q.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, Dh)
  scores = []
  for k, _, mask in segments:
    k, k_scale = _operand(k, q.dtype)
    s = jnp.einsum("bkqd,bksd->bkqs", qg, k, preferred_element_type=_F32)
    s = (s if k_scale is None else s * k_scale[:, :, None, :]) / math.sqrt(Dh)
    scores.append(jnp.where(mask[:, None, None], s.reshape(B, K, G, T, -1), _MASKED))
  top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
  exps = [jnp.exp(s - top) for s in scores]
  total = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)  # >= 1: the max term is exp(0)
  out = 0.0
  for e, (_, v, _) in zip(exps, segments):
    v, v_scale = _operand(v, q.dtype)
    p = (e / total).reshape(B, K, G * T, -1)
    p = (p if v_scale is None else p * v_scale[:, :, None, :]).astype(v.dtype)
    out = out + jnp.einsum("bkqs,bksd->bkqd", p, v, preferred_element_type=_F32)
  return out.reshape(B, K, G, T, Dh).transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh).astype(q.dtype)


def _operand(x, dtype) -> tuple[jax.Array, jax.Array | None]:
  """(matmul operand, per-slot scale [B, K, S] or None) of a segment's keys or values."""
  if isinstance(x, QuantizedKV):
    return x.values.astype(dtype), x.scale
  return x, None
