"""Samples inside packed rows: which tokens form one sample, per-sample sums and positions.

Shape legend: R rows, T tokens.

A row holds one sample or several (`rl.pack_update`); `segment_ids` [R, T] is non-zero and distinct
per sample within a row, 0 on padding. A sample is a run of one non-zero id together with the
padding after it, so the slot past a sample's last token (where the reference's critic mask ends)
stays with it. Every per-sample statistic goes through `runs`, so a row of one sample and a row of
several give the same numbers. The functions take numpy or jax arrays (`xp` picks the module).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def starts(segment_ids, xp=jnp):
  """[R, T] bool: the first position of each run (a row's start, or a new non-zero id)."""
  seg = segment_ids
  new = (seg[:, 1:] != seg[:, :-1]) & (seg[:, 1:] != 0)
  return xp.concatenate([xp.ones_like(new[:, :1]), new], axis=1)


def runs(segment_ids, xp=jnp):
  """[R, T] int32: the index of each token's run, counted over the flattened rows (< R * T)."""
  s = starts(segment_ids, xp)
  return (xp.cumsum(s.reshape(-1)) - 1).reshape(s.shape).astype(xp.int32)


def sums(x, segment_ids=None):
  """[R, T]: on every token, the sum of `x` over its sample (jax; a row is one sample without ids)."""
  if segment_ids is None:
    return jnp.broadcast_to(x.sum(-1, keepdims=True), x.shape)
  r = runs(segment_ids)
  return jax.ops.segment_sum(x.reshape(-1), r.reshape(-1), num_segments=r.size)[r]


def sums_np(x: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
  """`sums` on the host."""
  if segment_ids is None:
    return np.broadcast_to(x.sum(-1, keepdims=True), x.shape)
  r = runs(segment_ids, np)
  return np.bincount(r.reshape(-1), weights=x.reshape(-1), minlength=r.size)[r]


def positions(segment_ids: jax.Array) -> jax.Array:
  """[R, T] int32: each token's index within its run, so a packed sample sees the positions it
  would alone (RoPE)."""
  T = segment_ids.shape[-1]
  t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), segment_ids.shape)
  first = jax.lax.cummax(jnp.where(starts(segment_ids), t, 0), axis=segment_ids.ndim - 1)
  return t - first
