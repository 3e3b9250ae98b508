"""Log-probabilities of short alternative continuations ("branches") of each row's cached prefix, in
one cached forward pass that reads the KV cache and writes nothing.

Shapes: B cache rows, T new tokens per row (bucketed like appends), V vocabulary, W attended window.

A row's new tokens are [root, branch 0, branch 1, ...]. The root is the prefix's last token, run again
at its own slot so that its output is the distribution of every branch's first token. Each branch token
sees the cached slots before the root, the root and its own branch's earlier tokens (a tree mask), at
the position it would have if its branch alone followed the prefix. The cache is only read: writing
the branches would overwrite whatever the rows hold after the prefix, and a written copy of a donated
cache is a second cache in memory.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlver_jax.models.qwen2 import Qwen2
from rlver_jax.parallel.sharding import host_array
from rlver_jax.sampling.kv_cache import CacheView, KVCache
from rlver_jax.sampling.sampler import Sampler, bucket


@dataclasses.dataclass(frozen=True)
class BranchQuery:
  """One row's branches: its first `prefix_len` cached slots are the prefix, whose last token `root`
  sits at slot prefix_len - 1; each branch is a non-empty token sequence that may follow it."""
  prefix_len: int
  root: int
  branches: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    if self.prefix_len < 1 or not self.branches or not all(self.branches):
      raise ValueError(f"a branch query needs prefix_len >= 1 and non-empty branches; got "
                       f"prefix_len={self.prefix_len}, branch lengths {[len(b) for b in self.branches]}")

  @property
  def num_tokens(self) -> int:
    return 1 + sum(len(b) for b in self.branches)


class _ReadOnlyView:
  """A `CacheView` whose layer scan reads each layer's window and writes no new keys/values."""

  def __init__(self, view: CacheView):
    self.view = view

  def filled(self, num_new: int) -> jax.Array:
    return self.view.filled(num_new)

  def scan_layers(self, layer, x: jax.Array, layer_params: dict):
    v = self.view

    def body(h, p_l):
      p, l = p_l
      h, _ = layer(h, p, *v.layer_windows(l))
      return h, None

    x, _ = jax.lax.scan(body, x, (layer_params, jnp.arange(v.cache.k.shape[0])))
    return x, v.cache


def _score_fn(graphdef, params, cache: KVCache, context_B, tokens_BxT, positions_BxT, own_BxTxT,
              query_pos_BxT, query_id_BxT, stop_pos_BxT, extend_V, *, window):
  """Per query, log p(token | its position's context); per stop query, log p(no token of `extend_V`
  comes next). Log-probs in fp32 (the model's logits are fp32)."""
  model: Qwen2 = nnx.merge(graphdef, params)
  view = _ReadOnlyView(dataclasses.replace(cache, lengths=context_B).view(window))
  hidden, _ = model.cached_hidden_states(tokens_BxT, positions_BxT, view, own_mask=own_BxTxT)
  logits = model.logits(hidden)
  B, T, V = logits.shape
  logz = jax.nn.logsumexp(logits, axis=-1)
  flat = jnp.take_along_axis(logits.reshape(B, T * V), query_pos_BxT * V + query_id_BxT, axis=1)
  token_logp = flat - jnp.take_along_axis(logz, query_pos_BxT, axis=1)
  extend = jax.nn.logsumexp(jnp.where(extend_V, logits, -jnp.inf), axis=-1) - logz
  stop_logp = jnp.log(-jnp.expm1(jnp.minimum(extend, 0.0)))  # log(1 - p(extend)), -inf at p = 1
  return token_logp, jnp.take_along_axis(stop_logp, stop_pos_BxT, axis=1)


_score = jax.jit(_score_fn, static_argnames=("graphdef", "window"))


@dataclasses.dataclass
class _Layout:
  """The host arrays of one call: new tokens, their positions and tree mask, and the queries."""
  tokens: np.ndarray
  positions: np.ndarray
  own: np.ndarray
  query_pos: np.ndarray
  query_id: np.ndarray
  stop_pos: np.ndarray
  context: np.ndarray

  @staticmethod
  def empty(B: int, T: int, pad_id: int) -> "_Layout":
    own = np.broadcast_to(np.eye(T, dtype=bool), (B, T, T)).copy()  # padding sees itself only
    zeros = lambda: np.zeros((B, T), np.int32)
    return _Layout(np.full((B, T), pad_id, np.int32), zeros(), own, zeros(), zeros(), zeros(),
                   np.zeros(B, np.int32))

  def fill(self, b: int, q: BranchQuery) -> None:
    """Row b: the root at slot prefix_len - 1, each branch token at prefix_len + its index."""
    self.context[b] = q.prefix_len - 1
    self.tokens[b, 0], self.positions[b, 0] = q.root, q.prefix_len - 1
    n = 1
    for c, branch in enumerate(q.branches):
      seen, prev = [0], 0
      for i, tok in enumerate(branch):
        self.tokens[b, n], self.positions[b, n] = tok, q.prefix_len + i
        seen.append(n)
        self.own[b, n, seen] = True
        self.query_pos[b, n - 1], self.query_id[b, n - 1] = prev, tok  # predicted at `prev`
        prev, n = n, n + 1
      self.stop_pos[b, c] = prev


def score_branches(sampler: Sampler, params, cache: KVCache, queries: dict[int, BranchQuery],
                   extend_ids: Sequence[int] = ()) -> dict[int, np.ndarray]:
  """Per queried row, [C] fp64 log-probabilities of its branches after its prefix: the sum of the
  branch tokens' log-probs, plus log p(the next token is none of `extend_ids`) after the branch (so
  that a branch "+1" excludes "+10" when digits are the extensions). The cache is unchanged."""
  if not queries:
    return {}
  B = cache.batch_size
  T = bucket(max(q.num_tokens for q in queries.values()), sampler.append_buckets)
  layout = _Layout.empty(B, T, sampler.pad_id)
  for b, q in queries.items():
    layout.fill(b, q)
  window = bucket(max(int(layout.context.max()), 1), sampler.windows)
  extend = np.zeros(sampler.config.vocab_size, bool)
  extend[np.asarray(list(extend_ids), np.int64)] = True
  with sampler._on_mesh():  # the sampler's programs run under its mesh; so does this one
    token_logp, stop_logp = _score(
        sampler.graphdef, params, cache, jnp.asarray(layout.context), jnp.asarray(layout.tokens),
        jnp.asarray(layout.positions), jnp.asarray(layout.own), jnp.asarray(layout.query_pos),
        jnp.asarray(layout.query_id), jnp.asarray(layout.stop_pos), jnp.asarray(extend), window=window)
  token_logp, stop_logp = host_array(token_logp).astype(np.float64), host_array(stop_logp)
  out = {}
  for b, q in queries.items():
    ends = np.cumsum([len(branch) for branch in q.branches])
    sums = np.add.reduceat(token_logp[b, : ends[-1]], np.concatenate([[0], ends[:-1]]))
    out[b] = sums + stop_logp[b, : len(q.branches)].astype(np.float64)
  return out
