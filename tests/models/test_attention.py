"""Grouped-query attention against a per-head numpy reference, blocked queries == one block
(values and gradients), and keys split in segments (the cached-decode path) == concatenated keys,
including padded query rows and fully masked rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlver_jax.models.qwen2 import attention, segment_attention


def _inputs(B=2, T=40, W=8, H=6, K=2, Dh=16, seed=0):
  r = np.random.default_rng(seed)
  S = W + T
  q = r.standard_normal((B, T, H, Dh), np.float32)
  k = r.standard_normal((B, S, K, Dh), np.float32)
  v = r.standard_normal((B, S, K, Dh), np.float32)
  # Row 0: a 5-slot cached prefix then causal; row 1: no prefix, and its last 3 queries are padding.
  mask = np.zeros((B, T, S), bool)
  causal = np.tril(np.ones((T, T), bool))
  mask[0, :, :5] = True
  mask[0, :, W:] = causal
  mask[1, :, W:] = causal
  mask[1, T - 3:] = False
  return q, k, v, mask


def _reference(q, k, v, mask):
  B, T, H, Dh = q.shape
  G = H // k.shape[2]
  out = np.zeros_like(q)
  for b in range(B):
    for h in range(H):
      s = q[b, :, h] @ k[b, :, h // G].T / np.sqrt(Dh)
      s = np.where(mask[b], s, -1e30)
      p = np.exp(s - s.max(-1, keepdims=True))
      out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, h // G]
  return out


def test_matches_per_head_reference():
  q, k, v, mask = _inputs()
  np.testing.assert_allclose(attention(q, k, v, mask), _reference(q, k, v, mask), atol=2e-5)


@pytest.mark.parametrize("q_block", [16, 20, 7])
def test_query_blocks_equal_one_block_with_gradients(q_block):
  q, k, v, mask = _inputs()
  w = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)

  def loss(block):
    return lambda q, k, v: jnp.sum(attention(q, k, v, mask, q_block=block) * w)

  one = jax.value_and_grad(loss(10**6), argnums=(0, 1, 2))(q, k, v)
  blocked = jax.value_and_grad(loss(q_block), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(blocked[0], one[0], rtol=1e-5)
  for a, b in zip(blocked[1], one[1]):
    np.testing.assert_allclose(a, b, atol=1e-5)
  np.testing.assert_allclose(attention(q, k, v, mask, q_block=q_block), _reference(q, k, v, mask),
                             atol=2e-5)


@pytest.mark.parametrize("q_block", [10**6, 16])
def test_key_segments_equal_concatenated_keys(q_block):
  """A cache window [B, K, W, Dh] + new tokens as two segments with one softmax == one key set."""
  q, k, v, mask = _inputs()
  W = 8
  gemm = lambda a: jnp.asarray(a).transpose(0, 2, 1, 3)
  segments = ((gemm(k[:, :W]), gemm(v[:, :W]), mask[:, :, :W]),
              (gemm(k[:, W:]), gemm(v[:, W:]), mask[:, :, W:]))
  got = segment_attention(q, segments, q_block=q_block)
  np.testing.assert_allclose(got, _reference(q, k, v, mask), atol=2e-5)
  # Fully masked query rows (row 1's padding) are uniform over all keys of all segments, as in one set.
  np.testing.assert_allclose(got[1, -3:], attention(q, k, v, mask)[1, -3:], atol=2e-5)
  w = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
  g_seg = jax.grad(lambda q: jnp.sum(segment_attention(q, segments, q_block=q_block) * w))(q)
  g_one = jax.grad(lambda q: jnp.sum(attention(q, k, v, mask) * w))(q)
  np.testing.assert_allclose(g_seg, g_one, atol=1e-5)
