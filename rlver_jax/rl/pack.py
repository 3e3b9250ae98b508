"""Samples -> padded host arrays: the rows of one step's update batch, laid out by `BatchLayout`,
one sample a row or several (`packed_places`, `rl.pack_update`; `rl.samples` reads them back).

Shape legend: N packed rows, T tokens.

What is packed is described by Protocols (a rollout's `Sample` and `Dialogue` satisfy them), so rl/
stays independent of env/.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

import numpy as np

from rlver_jax.rl.batch import SEQ_MULTIPLE, BatchLayout, fine_bucket, shape_bucket


class PackableSample(Protocol):
  """One training sequence as the rollout made it."""
  tokens: Sequence[int]
  loss_mask: Sequence[int]          # 1 on tokens the policy sampled
  sampler_logp: Sequence[float]
  token_rewards: Mapping[int, float]  # token index -> reward


class PackableDialogue(Protocol):
  samples: Sequence[PackableSample]


@dataclasses.dataclass(frozen=True)
class Packed:
  """Samples padded into [N, T] host arrays (N a multiple of the micro-batch layout)."""
  tokens: np.ndarray        # int32, pad_id on padding
  segment_ids: np.ndarray   # int32, k + 1 on sample k's tokens (the step's order), 0 on padding
  loss_mask: np.ndarray     # float32
  rollout_logp: np.ndarray  # float32, the sampler's log-probs
  rewards: np.ndarray       # float32, per-token rewards
  dialogue: np.ndarray      # [N, T] int32 dialogue index of each token's sample (-1: padding)
  at: np.ndarray            # [num_real, 2] int32: (row, first token) of each sample
  num_real: int
  layout: BatchLayout
  # The row length the samples would have one a row: a sample that long has no slot past its end
  # (the reference critic's mask stops at its last token), in a longer packed row too. 0 = layout's.
  unpacked_length: int = 0

  @property
  def room_length(self) -> int:
    return self.unpacked_length or self.layout.length


def pack(dialogues: Sequence[PackableDialogue], micro_rows: int, pad_id: int, *,
         mini_batches: int = 1, mini_batch_rows: int = 0) -> Packed:
  """The samples of `dialogues`, one a row, in `mini_batches` mini-batches (`BatchLayout.of`)."""
  lengths = _lengths(dialogues)
  return pack_into(dialogues, BatchLayout.of(len(lengths), max(lengths, default=1), micro_rows,
                                             mini_batches=mini_batches,
                                             mini_batch_rows=mini_batch_rows), pad_id)


def pack_step(dialogues: Sequence[PackableDialogue], micro_rows: int, pad_id: int, *,
              mini_batch_rows: int, mini_batches: int, shards: int,
              pack_length: int | None = None) -> Packed:
  """The samples of `dialogues` in the step's layout (`step_places`)."""
  lengths = _lengths(dialogues)
  unpacked = BatchLayout.for_step(len(lengths), max(lengths, default=1), micro_rows,
                                  mini_batch_rows=mini_batch_rows, mini_batches=mini_batches,
                                  shards=shards)
  layout, places = _places_in(unpacked, lengths, micro_rows, shards, pack_length)
  return pack_into(dialogues, layout, pad_id, places, unpacked_length=unpacked.length)


def step_places(lengths: Sequence[int], micro_rows: int, *, mini_batch_rows: int, mini_batches: int,
                shards: int, pack_length: int | None = None
                ) -> tuple[BatchLayout, list[tuple[int, int]]]:
  """(layout, (row, first token) of each sample) of a step's samples of `lengths`: the step's
  mini-batch count (`BatchLayout.for_step`; `micro_rows` spans `shards` batch shards), one sample
  a row, or with `pack_length` (rl.pack_update) several (`packed_places`). The ahead-of-time
  step-time model lays out its stated lengths with it too."""
  layout = BatchLayout.for_step(len(lengths), max(lengths, default=1), micro_rows,
                                mini_batch_rows=mini_batch_rows, mini_batches=mini_batches,
                                shards=shards)
  return _places_in(layout, lengths, micro_rows, shards, pack_length)


def _places_in(unpacked: BatchLayout, lengths: Sequence[int], micro_rows: int, shards: int,
               pack_length: int | None) -> tuple[BatchLayout, list[tuple[int, int]]]:
  """`step_places` from the step's one-sample-a-row layout `unpacked`."""
  if pack_length is None:
    return unpacked, [(unpacked.row_of(k), 0) for k in range(len(lengths))]
  return packed_places(lengths, unpacked, micro_rows, shards, pack_length)


def _lengths(dialogues: Sequence[PackableDialogue]) -> list[int]:
  return [len(s.tokens) for d in dialogues for s in d.samples]


def packed_places(lengths: Sequence[int], unpacked: BatchLayout, micro_rows: int, shards: int,
                  pack_length: int) -> tuple[BatchLayout, list[tuple[int, int]]]:
  """(layout, (row, first token) of each sample) with several samples a row.

  Each sample stays in the mini-batch `unpacked` gives it, so the updates see the same samples;
  within a mini-batch, rows are filled first-fit by decreasing length. A sample takes one slot more
  than its tokens where `unpacked` has room for it (the reference critic's slot past its end, kept
  padding: `rl.samples`). Rows are `unpacked.length` long, or up to `pack_length` tokens where that
  is longer (fewer rows, more attention work per row). The layout's `mini_batch_rows` counts packed
  rows; its micro-batches are no larger than a mini-batch needs (`fitted_micro_rows`' rule).
  """
  T, M = unpacked.length, unpacked.mini_batches
  slots = [L + (L < T) for L in lengths]
  members: list[list[int]] = [[] for _ in range(M)]
  for k in range(len(lengths)):
    members[unpacked.mini_batch_of(k)].append(k)
  longest_part = max(sum(slots[k] for k in ks) for ks in members)
  length = max(T, min(pack_length, shape_bucket(longest_part, SEQ_MULTIPLE)))
  bins = [_first_fit([slots[k] for k in ks], length) for ks in members]
  need = max(max(len(b) for b in bins), 1)
  micro = min(micro_rows, shape_bucket(need, shards))
  R = fine_bucket(need, micro)
  layout = BatchLayout(M * R, length, micro, M, R)
  places = [(0, 0)] * len(lengths)
  for m, part in enumerate(bins):
    for b, content in enumerate(part):
      row, at = layout.row_of(m * R + b), 0
      for k in sorted(members[m][i] for i in content):  # in the step's order within the row
        places[k] = (row, at)
        at += slots[k]
  return layout, places


def _first_fit(sizes: Sequence[int], capacity: int) -> list[list[int]]:
  """Bins (lists of indices into `sizes`) from first-fit decreasing."""
  bins: list[list[int]] = []
  room: list[int] = []
  for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
    b = next((b for b, r in enumerate(room) if r >= sizes[i]), len(bins))
    if b == len(bins):
      bins.append([])
      room.append(capacity)
    bins[b].append(i)
    room[b] -= sizes[i]
  return bins


def pack_into(dialogues: Sequence[PackableDialogue], layout: BatchLayout, pad_id: int,
              places: Sequence[tuple[int, int]] | None = None, unpacked_length: int = 0) -> Packed:
  """The samples of `dialogues`, in order, at `places` (row, first token), by default each at the
  start of the row `layout.row_of` gives it."""
  samples = [s for d in dialogues for s in d.samples]
  if places is None:
    places = [(layout.row_of(k), 0) for k in range(len(samples))]
  N, T = layout.rows, layout.length
  out = Packed(np.full((N, T), pad_id, np.int32), np.zeros((N, T), np.int32),
               np.zeros((N, T), np.float32), np.zeros((N, T), np.float32),
               np.zeros((N, T), np.float32), np.full((N, T), -1, np.int32),
               np.array(places, np.int32).reshape(-1, 2), len(samples), layout, unpacked_length)
  owner = [i for i, d in enumerate(dialogues) for _ in d.samples]
  for k, s in enumerate(samples):
    i, a = places[k]
    span = slice(a, a + len(s.tokens))
    out.tokens[i, span] = s.tokens
    out.segment_ids[i, span] = k + 1
    out.loss_mask[i, span] = s.loss_mask
    out.rollout_logp[i, span] = s.sampler_logp
    for t, r in s.token_rewards.items():
      out.rewards[i, a + t] = r
    out.dialogue[i, span] = owner[k]
  return out
