"""Checksums of a checkpoint's arrays, so damaged bytes are found before anything trains on them.

At save, every array gets a fingerprint computed where it lives (one jitted pass over its bits; the
devices reduce their own shards and only a few scalars per array reach the host), stored in the
checkpoint's JSON item. At restore the restored arrays are fingerprinted the same way and compared,
and every float array must be finite: a flipped bit that the storage layer does not notice (no
checksum in its format) otherwise becomes NaN weights a step later, in every checkpoint after it.

The fingerprint of an array with bits b (viewed as unsigned integers) at flat index i is the pair
(sum b_i, sum b_i * (2i + 1)), both wrapping at 2^32: any change of one word changes the first, a
swap of two words the second, and modular sums do not depend on how the shards split the work.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rlver_jax.run.checkpoint_errors import DamagedCheckpoint, NonFiniteState

CHECKSUMS = "checksums"  # the key of the checkpoint's JSON item that holds them


def array_name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _words(x: jax.Array) -> jax.Array:
  """The array's bits as uint32 words (narrow dtypes widened, 8-byte ones split in two)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = x.dtype.itemsize
  if size < 4:
    return lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)
  return lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: a trailing axis of 2 words


def _fingerprint(x: jax.Array) -> jax.Array:
  """uint32[3]: the two sums and whether every value is finite (1) or not (0)."""
  w = _words(x)
  w = w[None] if w.ndim == 0 else w
  # Flat index i = r * C + c over rows r (the leading axes) and columns c (the last one): the sum of
  # b (2i + 1) is the sum of b (2c + 1) plus 2C r times each row's sum. Only the column weight
  # touches every word, and nothing is reshaped, which would regather a sharded array.
  columns = w.shape[-1]
  column_weight = lax.broadcasted_iota(jnp.uint32, w.shape, w.ndim - 1) * 2 + 1
  row_sums = jnp.sum(w, axis=-1, dtype=jnp.uint32)
  row_weighted = jnp.sum(w * column_weight, axis=-1, dtype=jnp.uint32)
  row = jnp.zeros(row_sums.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(row_sums.ndim)):
    row = row + lax.broadcasted_iota(jnp.uint32, row_sums.shape, axis) * jnp.uint32(stride % 2**32)
    stride *= row_sums.shape[axis]
  weighted = row_weighted + row_sums * row * jnp.uint32(2 * columns % 2**32)
  finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else True
  return jnp.stack([jnp.sum(row_sums, dtype=jnp.uint32), jnp.sum(weighted, dtype=jnp.uint32),
                    jnp.asarray(finite, jnp.uint32)])


@functools.lru_cache(maxsize=None)
def _program(out_sharding):
  def all_fingerprints(leaves):
    return jnp.stack([_fingerprint(x) for x in leaves]) if leaves else jnp.zeros((0, 3), jnp.uint32)
  return jax.jit(all_fingerprints, out_shardings=out_sharding)


def _replicated(leaves: list) -> jax.sharding.Sharding | None:
  """Every process gets the scalars when they are replicated over the arrays' mesh."""
  for x in leaves:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return None


def fingerprints(tree: Any) -> dict[str, tuple[int, int, bool]]:
  """array name -> (sum, weighted sum, finite) for every array of `tree`."""
  named = jax.tree_util.tree_leaves_with_path(tree)
  leaves = [x for _, x in named]
  out = _program(_replicated(leaves))(leaves)
  table = np.asarray(out.addressable_data(0))
  return {array_name(path): (int(row[0]), int(row[1]), bool(row[2]))
          for (path, _), row in zip(named, table)}


def checksums(tree: Any) -> dict[str, list[int]]:
  """What a save stores under meta[CHECKSUMS]; raises NonFiniteState naming the first array that
  holds NaN / inf (a checkpoint of it would be refused at restore, and rotate good ones out)."""
  table = fingerprints(tree)
  for name, (_, _, finite) in table.items():
    if not finite:
      raise NonFiniteState(f"array {name} holds NaN or inf values")
  return {name: [total, weighted] for name, (total, weighted, _) in table.items()}


def verify(tree: Any, saved: dict[str, list[int]] | None) -> None:
  """Raises DamagedCheckpoint naming the first array of `tree` whose fingerprint differs from
  `saved` (arrays `saved` lacks, as in a checkpoint of an older version, are not compared) or that
  holds NaN / inf."""
  for name, (total, weighted, finite) in fingerprints(tree).items():
    expected = (saved or {}).get(name)
    if expected is not None and [total, weighted] != list(expected):
      raise DamagedCheckpoint(f"array {name} differs from what was saved: checksum "
                              f"{total:08x}{weighted:08x}, saved {expected[0]:08x}{expected[1]:08x}")
    if not finite:
      raise DamagedCheckpoint(f"array {name} holds NaN or inf values")
