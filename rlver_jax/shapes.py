"""Padded sizes shared by the trainer and the ahead-of-time memory plan (they must agree)."""
from __future__ import annotations

SEQ_MULTIPLE = 64  # packed training lengths are whole multiples of this


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


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
