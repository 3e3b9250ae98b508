"""Bytes a compiled SPMD program sends between devices, read from its HLO text.

XLA's cost analysis leaves collectives out, but an FSDP-sharded decode all-gathers every layer's
weights each step. Per device, with n devices in the op's group (ring algorithms): an all-gather
receives (n-1)/n of its result, a reduce-scatter sends (n-1) x its result, an all-reduce 2 (n-1)/n of
its operand, an all-to-all (n-1)/n, a collective-permute its whole result. Async `-start` forms count
once (their `-done` is not a transfer).
"""
from __future__ import annotations

import math
import re

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
             "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_LINE = re.compile(r"= (?P<shape>.+?) (?P<op>" + "|".join(_OPS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


def _largest_array_bytes(shape: str) -> int:
  """The largest array of a result shape (a tuple's, for async starts: their output)."""
  sizes = [math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE.get(dtype, 4)
           for dtype, dims in _ARRAY.findall(shape)]
  return max(sizes, default=0)


def _group_size(line: str) -> int:
  """Devices in the op's replica group: `mesh[a=4,b=2] {a}` names its axes, `{{0,1,..},..}` lists them."""
  named = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if named:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", named.group(1)))
    return math.prod(int(sizes.get(a.strip().strip("'"), 1)) for a in named.group(2).split(","))
  listed = re.search(r"replica_groups=\{\{([^}]*)\}", line)
  if listed:
    return len(listed.group(1).split(","))
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
  return 2 if pairs else 1


def collective_bytes(hlo_text: str) -> float:
  """Bytes one device sends or receives over the interconnect in one run of the program."""
  total = 0.0
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if not m:
      continue
    size, n, op = _largest_array_bytes(m.group("shape")), _group_size(line), m.group("op")
    if n <= 1 and op != "collective-permute":
      continue
    share = (n - 1) / n
    total += {"all-gather": share * size, "reduce-scatter": (n - 1) * size,
              "all-reduce": 2 * share * size, "all-to-all": share * size,
              "collective-permute": size}[op]
  return total
