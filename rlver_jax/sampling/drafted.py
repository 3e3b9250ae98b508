"""A frozen model's decode with a draft, behind the plain `Sampler`'s methods.

The rollout (`env.rollout`) drives a policy through `Sampler`'s face: `init_cache`, `padded_rows`,
`prefill`, `append`, `copy_rows`, `decode`, `max_len`, `config`, and a cache with `batch_size`,
`lengths` and `with_lengths`. `DraftedSampler` gives that face to a `SpeculativeSampler` whose draft
weights are fixed, so a rollout of a frozen policy (an evaluation) decodes with a draft unchanged:
its cache is a `CachePair` (the target's and the draft's, always holding the same tokens) and
`counts` sums the draft's acceptance until taken. The tokens follow the plain decode's
distribution (greedy: the same tokens), as `sampling.speculative` guarantees.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from rlver_jax.sampling.kv_cache import KVCache
from rlver_jax.sampling.sampler import DecodeResult
from rlver_jax.sampling.speculative import DraftCounts, SpeculativeSampler


@dataclasses.dataclass(frozen=True)
class CachePair:
  """The target's cache and the draft's, rewound and reset together."""
  target: KVCache
  draft: KVCache

  @property
  def batch_size(self) -> int:
    return self.target.batch_size

  @property
  def lengths(self):
    return self.target.lengths

  def with_lengths(self, lengths) -> "CachePair":
    return CachePair(*SpeculativeSampler.with_lengths((self.target, self.draft), lengths))


class DraftedSampler:
  """`spec`'s target `Sampler`, decoding with `spec`'s draft (its weights `draft_params`)."""

  def __init__(self, spec: SpeculativeSampler, draft_params):
    self.spec, self.draft_params = spec, draft_params
    self.config = spec.target.config
    self.max_len = min(spec.target.max_len, spec.draft.max_len)
    self.counts = DraftCounts()

  def padded_rows(self, rows: int) -> int:
    return self.spec.padded_rows(rows)

  def init_cache(self, batch: int) -> CachePair:
    return CachePair(*self.spec.init_caches(batch))

  def prefill(self, params, cache: CachePair, rows: Sequence[Sequence[int]]):
    pair, logits = self.spec.prefill(params, self.draft_params, (cache.target, cache.draft), rows)
    return CachePair(*pair), logits

  def append(self, params, cache: CachePair, rows: Sequence[Sequence[int]], prev_logits=None):
    pair, logits = self.spec.append(params, self.draft_params, (cache.target, cache.draft), rows,
                                    prev_logits)
    return CachePair(*pair), logits

  def copy_rows(self, cache: CachePair, logits, sources: dict[int, int]):
    pair, logits = self.spec.copy_rows((cache.target, cache.draft), logits, sources)
    return CachePair(*pair), logits

  def decode(self, params, cache: CachePair, logits, **kw) -> DecodeResult:
    """`Sampler.decode` (same keywords) with the draft proposing; the result's cache is the pair."""
    r = self.spec.decode(params, self.draft_params, (cache.target, cache.draft), logits, **kw)
    self.counts.add(r)
    return dataclasses.replace(r.decode, cache=CachePair(r.decode.cache, r.draft_cache))
