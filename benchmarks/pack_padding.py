"""Padding in the update batch with and without packing (rl.pack_update), on sample lengths like the
paper's: the layouts the trainer makes (`rl.pack.step_places`), no model run.

Padding = 1 - real tokens / (rows x row length) over the step's rows, the empty rows of the shape
buckets included: the share of the update's (and each scoring pass's) token work spent on padding;
"in filled rows" leaves the bucket's empty rows out (what the packing itself leaves).

Length models (the paper reports a mean of ~2,300 tokens a sample in rows of 4,096):
  uniform: independent lengths, uniform on [500, 4096] (mean 2,298).
  think:   `grpo_think`'s samples, one a policy turn: dialogues of 4..8 turns (uniform), turn j's
           sample 600 + 450 (j - 1) + U(0, 400) tokens (the history grows a turn at a time), <= 4096.
Layout: `grpo_think`'s, 32 profiles x 4 dialogues, 128 samples a mini-batch (rl.mini_batch_rows=-1),
rl.micro_batch_size=4 on `--shards` batch shards.

  python pack_padding.py [--seeds 5] [--shards 1]
"""
from __future__ import annotations

import argparse

import _common  # noqa: F401
import numpy as np

from _common import command_line, table
from rlver_jax.rl.pack import step_places

DIALOGUES = 32 * 4


def uniform(rng) -> list[int]:
  return rng.randint(500, 4097, size=DIALOGUES).tolist()


def think(rng) -> list[int]:
  out = []
  for _ in range(DIALOGUES):
    for j in range(rng.randint(4, 9)):
      out.append(min(600 + 450 * j + rng.randint(0, 401), 4096))
  return out


def measure(lengths: list[int], shards: int, pack_length: int | None) -> tuple[float, ...]:
  """(padding share, rows, row length, padding share in the rows that hold samples)."""
  layout, places = step_places(lengths, 4 * shards, mini_batch_rows=DIALOGUES, mini_batches=1,
                               shards=shards, pack_length=pack_length)
  used = len({row for row, _ in places})
  real = sum(lengths)
  return (1 - real / (layout.rows * layout.length), layout.rows, layout.length,
          1 - real / (used * layout.length))


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--seeds", type=int, default=5)
  ap.add_argument("--shards", type=int, default=1)
  args = ap.parse_args()
  rows = []
  for name, model in (("uniform", uniform), ("think", think)):
    for label, pack_length in (("one a row", None), ("packed, rows as unpacked", 0),
                               ("packed, rows of 8192", 8192)):
      got = [measure(model(np.random.RandomState(seed)), args.shards, pack_length)
             for seed in range(args.seeds)]
      lengths = [np.mean(model(np.random.RandomState(s))) for s in range(args.seeds)]
      rows.append([name, f"{np.mean(lengths):.0f}", label, f"{np.mean([g[0] for g in got]):.1%}",
                   f"{np.mean([g[3] for g in got]):.1%}",
                   f"{np.mean([g[1] for g in got]):.0f}", f"{got[0][2]}",
                   f"{np.mean([g[1] * g[2] for g in got]) / 1e6:.2f}M"])
  print(f"command: {command_line()}\n")
  print(table(["lengths", "mean tokens", "layout", "padding", "in filled rows", "rows", "row length",
               "tokens computed"], rows))


if __name__ == "__main__":
  main()
