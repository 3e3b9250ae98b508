"""Token selection from logits with traced settings: greedy, temperature, top-k, top-p.

Shapes: B rows, V vocabulary. Every setting is a traced scalar, so changing it never recompiles:
temperature 0 means greedy, top_k 0 means off, top_p 1 means off. All math is fp32 (log-probs are
trained on; bf16 would bias them).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array

  @staticmethod
  def make(temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> "SamplingParams":
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
      raise ValueError(f"bad sampling settings: temperature={temperature} (>= 0), top_p={top_p} "
                       f"(in (0, 1]), top_k={top_k} (>= 0)")
    return SamplingParams(jnp.float32(temperature), jnp.float32(top_p), jnp.int32(top_k))


def filter_logits(logits_BxV: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Masks tokens outside the top-k and outside the top-p nucleus (logits already temperature-scaled).

  The nucleus is the smallest set of most likely tokens whose mass reaches top_p; a token is kept
  when the mass strictly before it is < top_p, so the most likely token is always kept.
  """
  V = logits_BxV.shape[-1]
  sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  kth = jnp.take(sorted_BxV, k - 1, axis=-1)[:, None]
  sorted_BxV = jnp.where(sorted_BxV >= kth, sorted_BxV, _NEG)
  probs = jax.nn.softmax(sorted_BxV, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = mass_before < top_p
  # Smallest kept logit = threshold; ties with it are kept too (measure zero for real logits).
  threshold = jnp.min(jnp.where(keep, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits_BxV >= threshold, logits_BxV, _NEG)


def sample(logits_BxV: jax.Array, key: jax.Array, params: SamplingParams):
  """Returns (tokens [B], log-prob under the sampling distribution [B], raw model log-prob [B])."""
  logits = logits_BxV.astype(jnp.float32)
  raw_logp = jax.nn.log_softmax(logits, axis=-1)
  greedy = params.temperature <= 0
  scaled = logits / jnp.where(greedy, 1.0, params.temperature)
  needs_filter = (params.top_k > 0) | (params.top_p < 1.0)
  # The sort behind filtering is the costly part of a step: skip it at run time when it is off.
  scaled = jax.lax.cond(needs_filter, lambda x: filter_logits(x, params.top_k, params.top_p),
                        lambda x: x, scaled)
  sampled = jax.random.categorical(key, scaled, axis=-1)
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
  sample_logp = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)[:, 0]
  sample_logp = jnp.where(greedy, 0.0, sample_logp)
  model_logp = jnp.take_along_axis(raw_logp, tokens[:, None], axis=-1)[:, 0]
  return tokens, sample_logp, model_logp
