"""The update batch: its padded sizes (`BatchLayout`), its arrays (`UpdateBatch`) and their placement.

Shape legend: N packed rows, T tokens, M micro-batches, B rows per micro-batch.

The trainer fills an `UpdateBatch` from a rollout; the ahead-of-time planner compiles the fused update
on `UpdateBatch.abstract(...)`. Both take their sizes from `BatchLayout`, so the compiled program and
the trained one cannot drift apart.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rlver_jax.parallel.sharding import DEFAULT_RULES, global_array

SEQ_MULTIPLE = 64  # packed training lengths are whole multiples of this

# Micro-batches on axis 0, each micro-batch's rows split over the batch mesh axes.
BATCH_AXES = (None, "batch", None)


def shape_bucket(n: int, unit: int) -> int:
  """The smallest unit * {1, 1.5} * 2^k >= n (unit, 2u, 3u, 4u, 6u, 8u, 12u, ...).

  Packed batch shapes take only these values, so the update, log-prob and value programs compile
  O(log) times over a run however the rollout lengths vary (each new shape is a recompile, minutes
  at 7B); padding stays under 50% and never changes results (it carries no loss weight).
  """
  units = max(-(-n // unit), 1)
  k = 0
  while True:
    for size in ((1 << k, 3 << (k - 1)) if k else (1,)):  # 2^k, then 1.5 * 2^k
      if size >= units:
        return size * unit
    k += 1


def fine_bucket(n: int, unit: int) -> int:
  """The smallest unit * m >= n with m in {1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, ...}
  (four sizes an octave): packed rows' count, where `shape_bucket`'s steps of up to 1.5x would
  bring back the padding packing removed, at up to twice its recompiles (O(log) still)."""
  units = max(-(-n // unit), 1)
  step = 1 << max(units.bit_length() - 3, 0)
  return -(-units // step) * step * unit


def mini_batch_count(num_samples: int, mini_batch_rows: int, mini_batches: int) -> int:
  """Mini-batches (optimizer updates per epoch) of a step: one per `mini_batch_rows` rows (the
  reference's count, which follows the rollout's size), or the fixed `mini_batches` when it is 0."""
  if mini_batch_rows > 0:
    return max(-(-num_samples // mini_batch_rows), 1)
  return mini_batches


def packed_rows(num_samples: int, micro_rows: int, mini_batches: int, mini_batch_rows: int) -> int:
  """N of a packed [N, T] batch: a bucketed multiple of micro_rows x mini_batches. With mini-batches
  counted in rows, every mini-batch but the last holds mini_batch_rows samples, so each needs room
  for that many."""
  need = num_samples
  if mini_batch_rows > 0 and mini_batches > 1:
    need = mini_batches * mini_batch_rows
  return shape_bucket(need, micro_rows * mini_batches)


def fitted_micro_rows(micro_rows: int, shards: int, num_samples: int, mini_batches: int,
                      mini_batch_rows: int) -> int:
  """`micro_rows` (rl.micro_batch_size on each of `shards` batch shards), or fewer where one
  mini-batch holds fewer samples than that: the rest would be padding rows, which carry no loss
  but cost the update and the scoring passes as much as real ones (`ppo_think` on v5p-64: 32-row
  mini-batches in 128-row micro-batches, 3/4 of the update's work on padding). A bucketed multiple
  of the shards (`shape_bucket`), so the programs still compile O(log) times. Which samples share a
  mini-batch does not change: it is fixed by `mini_batch_rows`, or there is one mini-batch; a fixed
  count of several (`mini_batch_rows` 0) fills micro-batches in order, so theirs stay as they are."""
  if mini_batch_rows > 0 and mini_batches > 1:
    per_mini_batch = mini_batch_rows
  elif mini_batches == 1:
    per_mini_batch = num_samples
  else:
    return micro_rows
  return min(micro_rows, shape_bucket(per_mini_batch, shards))


class BatchLayout(NamedTuple):
  """The padded sizes of one step's batch and where each sample goes in it.

  Mini-batch m is micro-batches m, m + M, m + 2M, ... of the [N / B, B] layout (`UpdateBatch.
  mini_batch`). Counted in rows (`mini_batch_rows` > 0), mini-batch m holds samples [m R, (m + 1) R),
  in order, like the reference's split; otherwise samples fill the rows in order.
  """
  rows: int             # N
  length: int           # T
  micro_rows: int       # B: global rows of one micro-batch
  mini_batches: int     # optimizer updates per epoch
  mini_batch_rows: int  # R: samples (packed: rows) per mini-batch (0: not counted in rows)

  @classmethod
  def of(cls, num_samples: int, longest: int, micro_rows: int, *, mini_batches: int = 1,
         mini_batch_rows: int = 0) -> BatchLayout:
    """The layout of `num_samples` samples of at most `longest` tokens."""
    return cls(packed_rows(num_samples, micro_rows, mini_batches, mini_batch_rows),
               shape_bucket(longest, SEQ_MULTIPLE), micro_rows, mini_batches, mini_batch_rows)

  @classmethod
  def for_step(cls, num_samples: int, longest: int, micro_rows: int, *, mini_batch_rows: int,
               mini_batches: int, shards: int) -> BatchLayout:
    """`of`, with a step's mini-batch count (`mini_batch_count`: `mini_batches` is the fixed count
    used when `mini_batch_rows` is 0) and micro-batches no larger than a mini-batch needs
    (`fitted_micro_rows`; `shards`: the batch shards that `micro_rows` spans)."""
    count = mini_batch_count(num_samples, mini_batch_rows, mini_batches)
    micro_rows = fitted_micro_rows(micro_rows, shards, num_samples, count, mini_batch_rows)
    return cls.of(num_samples, longest, micro_rows, mini_batches=count,
                  mini_batch_rows=mini_batch_rows)

  @property
  def step_shape(self) -> tuple[int, int, int]:
    """[M, B, T] of the whole step (every mini-batch)."""
    return self.rows // self.micro_rows, self.micro_rows, self.length

  @property
  def update_shape(self) -> tuple[int, int, int]:
    """[M, B, T] of one mini-batch: what one optimizer update sees."""
    return self.rows // (self.micro_rows * self.mini_batches), self.micro_rows, self.length

  def mini_batch_of(self, k: int) -> int:
    """The mini-batch of sample k."""
    return (self.row_of(k) // self.micro_rows) % self.mini_batches

  def row_of(self, k: int) -> int:
    """The row of sample k (of a layout with one sample a row; `rl.pack` places packed ones)."""
    if self.mini_batch_rows <= 0:
      return k
    B, M, R = self.micro_rows, self.mini_batches, self.mini_batch_rows
    m, j = divmod(k, R)
    return (m + M * (j // B)) * B + j % B


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """How an [M, B, T] batch array lies on `mesh`: rows over the batch mesh axes."""
  return DEFAULT_RULES.sharding(mesh, BATCH_AXES + (None,) * (len(shape) - 3), shape)


def to_device(x_MxBxT: np.ndarray, mesh: Mesh) -> jax.Array:
  """A host batch array, the same on every process, placed with `batch_sharding`."""
  return global_array(x_MxBxT, batch_sharding(mesh, x_MxBxT.shape))


_STATIC = dict(static=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UpdateBatch:
  """Every array the fused update reads, each [M, B, T] and token-aligned (index t describes token t).

  int32: tokens, segment_ids (a sample's id on its tokens, 0 on padding; several samples may share
  a row, `rl.samples`). float32: the rest. A pytree: `jit`
  and `lax.scan` see its arrays, `mini_batches` is static. Optional fields are None when the step
  has no use for them: `ref_logp` only with a KL term in the loss, `old_values` and `returns` only
  for a critic, `weights` until `Updater.step` adds them, `rollout_logp` only in hand-built batches,
  `value_mask` only where the critic trains on other tokens than the policy (`critic.value_mask`).
  """
  tokens: jax.Array
  segment_ids: jax.Array
  loss_mask: jax.Array      # 1 on tokens the policy sampled
  old_logp: jax.Array       # the policy's log-probs at the rollout's weights
  advantages: jax.Array
  rollout_logp: jax.Array | None = None  # the sampler's own log-probs (truncated IS)
  weights: jax.Array | None = None       # per-token loss weights over the whole mini-batch
  ref_logp: jax.Array | None = None      # the reference policy's log-probs (KL in the loss)
  old_values: jax.Array | None = None    # the critic's values at the rollout's weights
  returns: jax.Array | None = None
  value_mask: jax.Array | None = None    # the tokens the critic trains on (None: loss_mask)
  mini_batches: int = dataclasses.field(default=1, metadata=_STATIC)  # updates per epoch in it

  @classmethod
  def abstract(cls, shape: tuple[int, int, int], mesh: Mesh | None, *, ref_logp: bool,
               values: bool) -> UpdateBatch:
    """One mini-batch as the jitted update receives it (with `weights`): ShapeDtypeStructs, sharded
    like `to_device` places them (unsharded without a mesh)."""
    sharding = None if mesh is None else batch_sharding(mesh, shape)
    spec = lambda dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    f32 = spec(jnp.float32)
    return cls(tokens=spec(jnp.int32), segment_ids=spec(jnp.int32), loss_mask=f32, old_logp=f32,
               advantages=f32, rollout_logp=f32, weights=f32, ref_logp=f32 if ref_logp else None,
               old_values=f32 if values else None, returns=f32 if values else None,
               value_mask=f32 if values else None)

  def trained_mask(self, loss: str) -> jax.Array:
    """The tokens a loss trains on: the critic's `value_mask` where there is one, else `loss_mask`."""
    if loss == "value" and self.value_mask is not None:
      return self.value_mask
    return self.loss_mask

  def arrays(self) -> dict[str, jax.Array]:
    """The fields that are present, by name, in field order."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != "mini_batches" and getattr(self, f.name) is not None}

  def mini_batch(self, part: int) -> UpdateBatch:
    """Mini-batch `part` of a step's batch: micro-batches part, part + M, ... (`BatchLayout`)."""
    M = self.mini_batches
    return dataclasses.replace(jax.tree.map(lambda x: x[part::M], self), mini_batches=1)
