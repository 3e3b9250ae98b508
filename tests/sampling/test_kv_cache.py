"""CacheView: the filled-slot mask, and the same reads and writes through either layout."""
import jax.numpy as jnp
import numpy as np

from rlver_jax.models.presets import Qwen2Config
from rlver_jax.sampling.kv_cache import LAYOUTS, KVCache

L, B, K, S, Dh, T, W = 2, 3, 2, 16, 4, 3, 8


def _cache(layout):
  config = Qwen2Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=L, num_heads=K,
                       num_kv_heads=K, head_dim=Dh)
  cache = KVCache.allocate(config, B, S, jnp.float32, layout=layout)
  return cache.with_lengths(np.array([0, 5, 14]))


def test_filled_marks_each_rows_cached_slots():
  view = _cache("heads_major").view(W)
  filled = np.asarray(view.filled(T))
  assert filled.shape == (B, T, W)
  np.testing.assert_array_equal(filled[:, 0].sum(-1), [0, 5, 8])
  assert (filled == filled[:, :1]).all()


def test_both_layouts_read_and_write_the_same_slots():
  """Each layer sees its window [B, K, W, Dh] and its new keys land at slots lengths..lengths+T-1
  (past the end: dropped), in either layout."""
  out = {}
  for layout in LAYOUTS:
    seen = []

    def layer(h, p, k_window, v_window):
      seen.append(k_window.shape)
      new = jnp.broadcast_to(p[:, None, None, None] + jnp.arange(T)[None, None, :, None] + 1.0,
                             (B, K, T, Dh))
      return h + jnp.sum(k_window), (new, -new)

    per_layer = jnp.arange(L * B, dtype=jnp.float32).reshape(L, B)  # layer l, row b: l * B + b
    x, cache = _cache(layout).view(W).scan_layers(layer, jnp.zeros((B, T, 1)), per_layer)
    assert seen == [(B, K, W, Dh)]
    k = np.asarray(cache.k) if layout == "heads_major" else np.asarray(cache.k).transpose(0, 1, 3, 2, 4)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [0, 5, 14])
    out[layout] = (np.asarray(x), k)
  (xa, ka), (xb, kb) = out.values()
  np.testing.assert_array_equal(xa, xb)
  np.testing.assert_array_equal(ka, kb)
  assert (ka[:, 0, :, :T] > 0).all() and (ka[:, 0, :, T:] == 0).all()
  assert (ka[:, 1, :, 5:5 + T] > 0).all() and (ka[:, 1, :, :5] == 0).all()
  assert (ka[:, 2, :, 14:] > 0).all()  # the third token fell past the end
  np.testing.assert_array_equal(ka[1, 1, 0, 5:8, 0], [5.0, 6.0, 7.0])  # p = layer 1, row 1 -> 4, + t + 1
