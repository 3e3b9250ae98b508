"""The speculative-sampling rule: which of a draft's proposed tokens a target keeps, and what it
samples in their place, so that every kept token follows the target's own sampling distribution.

Shapes: B rows, k proposed tokens per row, V vocabulary.

Both models' distributions are the ones `strategies.sample` draws from: temperature, then top-k and
top-p on the scaled logits (`filter_logits`), softmax; temperature 0 is the one-hot of the first
maximum. Proposal x_i ~ q_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); the first rejected
position i samples from normalize(max(0, p_i - q_i)); if all k are kept, one more token comes from
p_k. Each emitted token is then distributed as p given the tokens before it (Leviathan et al. 2023,
Chen et al. 2023). With one-hot p and q this is greedy decoding: a proposal is kept iff it is the
target's argmax, and the replacement is that argmax. All math in fp32 (ratios of small probabilities).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rlver_jax.sampling.strategies import SamplingParams, _argmax, categorical, filter_logits

_NEG = -1e30  # finite like the filters' mask: exp gives 0, and no inf - inf = NaN


def token_logprobs(logits_RxV: jax.Array, sampling: SamplingParams) -> jax.Array:
  """[R, V] fp32 log-probabilities of the sampling distribution (`_NEG` where a token has none)."""
  logits = logits_RxV.astype(jnp.float32)
  top = jnp.max(logits, axis=-1, keepdims=True)

  def greedy(_):
    hot = jnp.arange(logits.shape[-1])[None, :] == _argmax(logits, top)[:, None]
    return jnp.where(hot, 0.0, _NEG)

  def sampled(_):
    scaled = filter_logits((logits - top) / sampling.temperature, sampling.top_k, sampling.top_p)
    return jax.nn.log_softmax(scaled, axis=-1)

  return jax.lax.cond(sampling.temperature <= 0, greedy, sampled, None)


def row_keys(rng: jax.Array, i) -> jax.Array:
  """The key of draw `i`: from the call's key, or from each row's own ([B] keys)."""
  if rng.ndim:
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(rng, i)
  return jax.random.fold_in(rng, i)


def draw(key: jax.Array, logp_BxV: jax.Array) -> jax.Array:
  """[B] tokens drawn from exp(logp) (one key, or one per row)."""
  return categorical(key, logp_BxV)


def _uniform(key: jax.Array, B: int, k: int) -> jax.Array:
  if key.ndim:
    return jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(key)
  return jax.random.uniform(key, (B, k))


def verify(p_logp_BxK1xV: jax.Array, q_logp_BxKxV: jax.Array, x_BxK: jax.Array, key: jax.Array):
  """Returns (n [B] proposals kept, y [B] the token after them: the rejected position's
  replacement, or the bonus token from p_k when all k were kept).

  p_logp: the target's log-probs before each proposal and after the last ([B, k+1, V]);
  q_logp: the draft's before each proposal ([B, k, V]); x: the proposals, drawn from q.
  """
  B, k = x_BxK.shape
  p = jnp.exp(p_logp_BxK1xV.astype(jnp.float32))
  q = jnp.exp(q_logp_BxKxV.astype(jnp.float32))
  pick = lambda a, t: jnp.take_along_axis(a, t[..., None], axis=-1)[..., 0]
  key_u, key_y = jax.random.split(key) if not key.ndim else jax.vmap(jax.random.split, out_axes=1)(key)
  # u < p/q written without the division; q(x) > 0 as x was drawn from q.
  kept = _uniform(key_u, B, k) * pick(q, x_BxK) < pick(p[:, :k], x_BxK)
  n = jnp.sum(jnp.cumprod(kept.astype(jnp.int32), axis=1), axis=1)
  q_ext = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q = 0 after the last: y ~ p_k
  at = lambda a: jnp.take_along_axis(a, n[:, None, None], axis=1)[:, 0]
  p_n = at(p)
  residual = jnp.maximum(p_n - at(q_ext), 0.0)
  # Where p_n <= q_n everywhere (equal up to rounding) a rejection has probability ~0: fall back to p_n.
  dist = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
  y = draw(key_y, jnp.where(dist > 0, jnp.log(dist), _NEG))
  return n.astype(jnp.int32), y
