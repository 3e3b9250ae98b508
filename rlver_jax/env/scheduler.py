"""Continuous batching of dialogues: which dialogue holds which cache row, which wait, and the
per-dialogue random streams that make a dialogue's tokens independent of both.

With `rollout.rows` = R < dialogues, the policy's and the simulator's caches have R rows. A row is
lent to one dialogue from its start to its end (`RowSlots`); when it ends, the next waiting
dialogues start in the freed rows (`AdmissionQueue`), a GRPO group's members together so their
shared prefix is prefilled once and copied. Each dialogue samples from its own key stream
(`dialogue_keys`: the base key folded with the dialogue id, then with the dialogue's own call
count), never from its row or from when it ran, so its tokens equal those of the all-rows run.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import jax
import numpy as np

_NO_DIALOGUE = np.uint32(0xFFFFFFFF)  # the key data of a row nobody holds (its draws are unused)


class RowSlots:
  """Cache rows lent to dialogues: `take` lends the lowest free row, `release` gives it back."""

  def __init__(self, rows: int):
    if rows < 1:
      raise ValueError(f"need at least one cache row, got {rows}")
    self.rows = rows
    self._free = list(range(rows))
    self.row_of: dict[int, int] = {}  # dialogue id -> its row, while it runs

  @property
  def free(self) -> int:
    return len(self._free)

  def take(self, dialogue: int) -> int:
    if dialogue in self.row_of:
      raise ValueError(f"dialogue {dialogue} already holds row {self.row_of[dialogue]}")
    if not self._free:
      raise RuntimeError(f"no free cache row for dialogue {dialogue}: all {self.rows} are lent "
                         f"(to dialogues {sorted(self.row_of)})")
    self.row_of[dialogue] = heapq.heappop(self._free)
    return self.row_of[dialogue]

  def release(self, dialogue: int) -> int:
    row = self.row_of.pop(dialogue)
    heapq.heappush(self._free, row)
    return row

  def holders(self, batch: int) -> list[int | None]:
    """Per cache row (of `batch`, padding included), the dialogue holding it or None."""
    out: list[int | None] = [None] * batch
    for dialogue, row in self.row_of.items():
      out[row] = dialogue
    return out


class AdmissionQueue:
  """The dialogues not started yet, in units that start together (a group: its rows share their
  opening), first come first served: a unit that does not fit in the free rows waits, and so do
  the ones behind it (the order, and with it every row's history, stays that of the group ids)."""

  def __init__(self, group_ids: Sequence[int], rows: int, *, together: bool = True):
    units: dict = {}
    for d, g in enumerate(group_ids):
      units.setdefault(g if together else ("dialogue", d), []).append(d)
    self._units = list(units.values())
    largest = max((len(u) for u in self._units), default=0)
    if largest > rows:
      raise ValueError(f"rollout.rows={rows}: a group of {largest} dialogues starts together, so "
                       f"the rows must be at least {largest} (rl.group_size)")

  @property
  def waiting(self) -> bool:
    return bool(self._units)

  def next_dialogues(self, free: int) -> list[int]:
    """The dialogues of the next units that fit in `free` rows, in order (removed from the queue)."""
    out: list[int] = []
    while self._units and len(out) + len(self._units[0]) <= free:
      out += self._units.pop(0)
    return out


@jax.jit
def _fold_keys(base: jax.Array, dialogues: jax.Array, counts: jax.Array) -> jax.Array:
  return jax.vmap(lambda d, n: jax.random.fold_in(jax.random.fold_in(base, d), n))(dialogues, counts)


def dialogue_keys(base: jax.Array, holders: Sequence[int | None], counts: Sequence[int]) -> jax.Array:
  """[rows] keys: row r's is `base` folded with the dialogue holding it and that dialogue's call
  count `counts[r]` (its policy turn, or its simulator generation); rows nobody holds get a key
  whose draws nobody reads."""
  dialogues = np.array([_NO_DIALOGUE if d is None else d for d in holders], np.uint32)
  return _fold_keys(base, dialogues, np.asarray(counts, np.uint32))
