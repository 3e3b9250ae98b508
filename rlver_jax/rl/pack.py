"""Samples -> padded host arrays: the rows of one step's update batch, laid out by `BatchLayout`.

Shape legend: N packed rows, T tokens.

What is packed is described by Protocols (a rollout's `Sample` and `Dialogue` satisfy them), so rl/
stays independent of env/.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

import numpy as np

from rlver_jax.rl.batch import BatchLayout


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
  segment_ids: np.ndarray   # int32, 1 on real tokens
  loss_mask: np.ndarray     # float32
  rollout_logp: np.ndarray  # float32, the sampler's log-probs
  rewards: np.ndarray       # float32, per-token rewards
  dialogue: np.ndarray      # [N] int32 dialogue index per row (-1: padding)
  num_real: int
  layout: BatchLayout


def pack(dialogues: Sequence[PackableDialogue], micro_rows: int, pad_id: int, *,
         mini_batches: int = 1, mini_batch_rows: int = 0) -> Packed:
  """The samples of `dialogues` in `mini_batches` mini-batches (`BatchLayout.of`)."""
  num, longest = _sizes(dialogues)
  return pack_into(dialogues, BatchLayout.of(num, longest, micro_rows, mini_batches=mini_batches,
                                             mini_batch_rows=mini_batch_rows), pad_id)


def pack_step(dialogues: Sequence[PackableDialogue], micro_rows: int, pad_id: int, *,
              mini_batch_rows: int, mini_batches: int, shards: int) -> Packed:
  """The samples of `dialogues` in the step's mini-batch count (`BatchLayout.for_step`;
  `micro_rows` spans `shards` batch shards)."""
  num, longest = _sizes(dialogues)
  return pack_into(dialogues, BatchLayout.for_step(num, longest, micro_rows,
                                                   mini_batch_rows=mini_batch_rows,
                                                   mini_batches=mini_batches, shards=shards), pad_id)


def _sizes(dialogues: Sequence[PackableDialogue]) -> tuple[int, int]:
  """(samples, tokens of the longest)."""
  samples = [s for d in dialogues for s in d.samples]
  return len(samples), max((len(s.tokens) for s in samples), default=1)


def pack_into(dialogues: Sequence[PackableDialogue], layout: BatchLayout, pad_id: int) -> Packed:
  """The samples of `dialogues`, in order, in the rows `layout.row_of` gives them."""
  samples = [s for d in dialogues for s in d.samples]
  N, T = layout.rows, layout.length
  out = Packed(np.full((N, T), pad_id, np.int32), np.zeros((N, T), np.int32),
               np.zeros((N, T), np.float32), np.zeros((N, T), np.float32),
               np.zeros((N, T), np.float32), np.full((N,), -1, np.int32), len(samples), layout)
  owner = [i for i, d in enumerate(dialogues) for _ in d.samples]
  for k, s in enumerate(samples):
    i = layout.row_of(k)
    L = len(s.tokens)
    out.tokens[i, :L] = s.tokens
    out.segment_ids[i, :L] = 1
    out.loss_mask[i, :L] = s.loss_mask
    out.rollout_logp[i, :L] = s.sampler_logp
    for t, r in s.token_rewards.items():
      out.rewards[i, t] = r
    out.dialogue[i] = owner[k]
  return out
