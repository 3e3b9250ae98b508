"""A step's program calls as metrics (`calls/...` in metrics.jsonl): what `rlver_jax.aot --estimate_time
--calls_from=` multiplies the compiled programs' costs by.

Sampler programs come from each sampler's `CallCounts` (policy, and the co-located simulator's), the
update's from the packed batch: `calls/update/micro_batches` optimizer micro-batch steps of
`calls/update/rows` x `calls/update/length` tokens each (per model trained: the critic's steps are as
many), and `calls/forward/micro_batches` scoring passes of the same shape (old log-probs, the
reference's, the critic's values).
"""
from __future__ import annotations

from typing import Any


def take_sampler_calls(sampler, backend) -> dict[str, float]:
  """The sampler calls since the last take, as `calls/policy/KEY` and `calls/simulator/KEY` (a
  simulator's draft: `calls/simulator_draft/KEY`), and the draft's acceptance
  (`simulator/draft_acceptance`, `simulator/tokens_per_verify`); zeroes them."""
  out = {f"calls/policy/{k}": float(v) for k, v in sampler.calls.take().items()}
  simulator = getattr(backend, "sampler", None)  # only the co-located model backend has one
  if simulator is not None:
    out.update({f"calls/simulator/{k}": float(v) for k, v in simulator.calls.take().items()})
  spec = getattr(backend, "spec", None)  # its draft-and-verify decode, when it has a draft
  if spec is not None:
    out.update({f"calls/simulator_draft/{k}": float(v) for k, v in spec.draft.calls.take().items()})
  take_draft = getattr(backend, "take_draft_metrics", None)
  if take_draft is not None:
    out.update(take_draft())
  return out


def update_calls(step_shape: tuple[int, int, int], mini_batches: int, optimizer_updates: float, *,
                 scoring_passes: int) -> dict[str, Any]:
  """`step_shape` [M, B, T] of the packed step, `mini_batches` of it; each optimizer update runs
  M / mini_batches micro-batches; each scoring pass (log-probs, values) runs all M."""
  M, B, T = step_shape
  return {"calls/update/micro_batches": float(M // mini_batches * optimizer_updates),
          "calls/update/rows": float(B), "calls/update/length": float(T),
          "calls/forward/micro_batches": float(M * scoring_passes)}
