"""What a compiled SPMD program's collectives send between devices, read from its HLO text.

XLA's cost analysis leaves collectives out, but an FSDP-sharded decode all-gathers every layer's
weights each step, and a tensor-parallel one all-reduces every layer's activations. Per device, with n
devices in the op's group (ring algorithms): an all-gather receives (n-1)/n of its result, a
reduce-scatter sends (n-1) x its result, an all-reduce 2 (n-1)/n of its operand, an all-to-all (n-1)/n,
a collective-permute its whole result. A ring takes n-1 sequential steps (an all-reduce 2 (n-1), a
permute 1), each paying the link's latency however small the message: the `hops`.

A combined op (XLA merges small all-reduces into one with a tuple result) counts every array of its
tuple. Async `-start` forms count once (their `-done` is not a transfer); an all-gather-start's or a
collective-permute-start's tuple holds (operands, results, ...): its results count.

Replica groups, as XLA and libtpu print them (n = devices in one group):
  replica_groups={{0,1,2,3},{4,5,6,7}}    listed: n = the first group's length
  replica_groups=[2,4]<=[8]                iota: 2 groups of 4 (the devices 0..7 reshaped [2,4]): n = 4
  replica_groups=[4,2]<=[2,4]T(1,0)        iota, transposed first: still [groups, n]: n = 2
  replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}   named axes: n = the product of their sizes,
      also with `, device_ids=([2,4]T(1,0))` (a device order) between the mesh and the axes
  replica_groups={} (or none printed)      every device of the program: n = `devices`

Exposed collectives (`exposed_links`): the compiled program is scheduled (one stream per chip), so a
collective hides behind other work only where the compiler split it into `-start` and `-done` with
work between them. A synchronous collective holds the stream: the op after it waits (most often it
is the op that consumes its result). Both kinds with nothing scheduled between the collective's
start and its first use add their link time to the program's.
"""
from __future__ import annotations

import dataclasses
import math
import re

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
             "u32": 4, "f64": 8, "s64": 8, "u64": 8}
OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_LINE = re.compile(r"= (?P<shape>.+?) (?P<op>" + "|".join(OPS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}")
_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=")
_LISTED = re.compile(r"replica_groups=\{\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Link:
  """One device's share of a program's collectives of one kind: how many, bytes, ring steps."""
  ops: int = 0
  bytes: float = 0.0
  hops: int = 0

  def __add__(self, other: "Link") -> "Link":
    return Link(self.ops + other.ops, self.bytes + other.bytes, self.hops + other.hops)


def _arrays_bytes(shape: str) -> int:
  return sum(math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE.get(dtype, 4)
             for dtype, dims in _ARRAY.findall(shape))


def _tuple_items(shape: str) -> list[str]:
  """The top-level elements of a tuple shape `(a, (b, c), d)`; [shape] if it is not a tuple."""
  if not shape.startswith("("):
    return [shape]
  items, depth, start = [], 0, 1
  for i, ch in enumerate(shape):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 1:
      items.append(shape[start:i])
      start = i + 1
  items.append(shape[start:-1])
  return [s.strip() for s in items]


def _result_bytes(shape: str, op: str, start: bool) -> int:
  """Bytes of the op's result: every array of a combined op's tuple; an all-gather-start's or a
  collective-permute-start's tuple is (operands, results, context), of which the results count."""
  if start and op in ("all-gather", "collective-permute"):
    items = _tuple_items(shape)
    shape = items[1] if len(items) > 1 else shape
  return _arrays_bytes(shape)


def group_size(line: str, devices: int) -> int:
  """Devices in one replica group of the op on `line` (the forms in the module docstring)."""
  named = _MESH.search(line)
  if named:
    sizes = dict(re.findall(r"'?([\w.]+)'?=(\d+)", named.group(1)))
    return math.prod(int(sizes[a.strip().strip("'")]) for a in named.group(2).split(",") if a.strip())
  iota = _IOTA.search(line)
  if iota:
    return int(iota.group(1).split(",")[-1])
  listed = _LISTED.search(line)
  if listed:
    return len(listed.group(1).split(","))
  return devices  # `replica_groups={}` or none: all of the program's devices


def collective_links(hlo_text: str, devices: int) -> dict[str, Link]:
  """Per kind of collective, what one device of a `devices`-device program moves in one run."""
  links: dict[str, Link] = {}
  for line in hlo_text.splitlines():
    found = _collective(line, devices)
    if found is not None:
      links[found[0]] = links.get(found[0], Link()) + found[1]
  return links


# Ops that do work a collective in flight can overlap with; anything else (bitcast, tuple, copy of a
# scalar, ...) is bookkeeping of the schedule.
_WORK = ("fusion", "convolution", "dot", "custom-call", "while", "conditional", "call", "sort",
         "scatter", "gather", "reduce", "copy-start")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>.+?) (?P<op>[a-z][\w\-]*)\(")


def _collective(line: str, devices: int) -> tuple[str, Link] | None:
  """(kind, this op's link use) of a collective's line; None for other lines or 1-device groups."""
  m = _LINE.search(line)
  if not m:
    return None
  op = m.group("op")
  size = _result_bytes(m.group("shape"), op, bool(m.group("start")))
  if op == "collective-permute":
    return op, Link(1, size, 1)
  n = group_size(line, devices)
  if n <= 1:
    return None
  share = (n - 1) / n
  moved = {"all-gather": share * size, "reduce-scatter": (n - 1) * size,
           "all-reduce": 2 * share * size, "all-to-all": share * size}[op]
  return op, Link(1, moved, 2 * (n - 1) if op == "all-reduce" else n - 1)


def _exposed(lines: list[str], i: int, name: str) -> bool:
  """Whether no work is scheduled between the collective at `lines[i]` and its first use (its
  `-done` for an async start) in the same computation."""
  used = re.compile(r"%" + re.escape(name) + r"[,)\s]")
  for line in lines[i + 1:]:
    if not line.startswith("  ") or line.strip() == "}":
      return True  # end of the computation: its result leaves it
    m = _INSTR.match(line)
    if m is None:
      continue
    if used.search(line.partition(" = ")[2]):
      return True
    if m.group("op") in _WORK:
      return False
  return True


def exposed_links(hlo_text: str, devices: int) -> Link:
  """What one device's collectives that nothing overlaps (see the module docstring) move in one
  run of the program."""
  lines = hlo_text.splitlines()
  total = Link()
  for i, line in enumerate(lines):
    found = _collective(line, devices)
    if found is None:
      continue
    start = _INSTR.match(line)
    if start is None:
      continue
    synchronous = not start.group("op").endswith("-start")
    if synchronous or _exposed(lines, i, start.group("name")):
      total = total + found[1]
  return total


def collective_bytes(hlo_text: str, devices: int) -> float:
  """Bytes one device sends or receives over the interconnect in one run of the program."""
  return sum(link.bytes for link in collective_links(hlo_text, devices).values())
