"""How many times a sampler ran each of its compiled programs: the input of the step-time model.

A program is named by its static shape: an append (or prefill) chunk by its token bucket T and its
attended window W, a decode by its window W. A decode call counts its loop iterations (steps): the
loop runs until the last active row stops, so its steps are the most tokens any row generated.
Keys are flat strings (`append/T64/W512`, `prefill/T1024/W64`, `decode_steps/W512`, `decode_calls`,
`prefill_calls`; a draft-and-verify decode: `verify_calls`, `verify_passes/W512` (target passes of
k + 1 tokens), `draft_steps/W512`), so they go into metrics.jsonl as they are.
"""
from __future__ import annotations

import collections


class CallCounts:
  """Counts of one sampler's program calls since the last `take`."""

  def __init__(self):
    self._counts: collections.Counter[str] = collections.Counter()

  def append_chunk(self, kind: str, tokens: int, window: int) -> None:
    """One append program call (`kind` "append" or "prefill") of `tokens` (bucketed) at `window`."""
    self._counts[f"{kind}/T{tokens}/W{window}"] += 1

  def prefill(self) -> None:
    self._counts["prefill_calls"] += 1

  def decode(self, window: int, steps: int) -> None:
    """One decode call at `window` whose loop ran `steps` iterations."""
    self._counts["decode_calls"] += 1
    self._counts[f"decode_steps/W{window}"] += steps

  def verify(self, window: int, draft_window: int, passes: int, k: int) -> None:
    """One draft-and-verify call at target `window` whose loop ran `passes` target passes (the
    closing write included), each after k draft steps at `draft_window`."""
    self._counts["verify_calls"] += 1
    self._counts[f"verify_passes/W{window}"] += passes
    self._counts[f"draft_steps/W{draft_window}"] += k * max(passes - 1, 0)

  def take(self) -> dict[str, int]:
    """The counts so far (sorted by key), then zero."""
    out = dict(sorted(self._counts.items()))
    self._counts.clear()
    return out
