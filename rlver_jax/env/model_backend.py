"""The co-located simulator backend: a Qwen2-family model on the same mesh, run by our sampler.

All live dialogues are generated as one batch. Each row keeps its KV cache across calls: a call
appends only the row's new messages (ChatML fragments) plus an assistant header, then decodes. The
simulator's context is therefore append-only and never re-prefilled.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from rlver_jax.env.backends import HistoryBackend, SimRequest, SimulatorBackendError
from rlver_jax.models.tokenizer import ChatTokens
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams


class ModelBackend(HistoryBackend):
  """Simulated-user text from a local model; `generate` batches all requested rows."""

  def __init__(self, sampler: Sampler, params, chat: ChatTokens, *, max_new_tokens: int,
               sampling: SamplingParams, seed: int = 0):
    super().__init__()
    self.sampler = sampler
    self.params = params
    self.chat = chat
    self.max_new_tokens = max_new_tokens
    self.sampling = sampling
    self.rng = jax.random.key(seed)
    self.cache = None
    self.logits = None
    self.closed: list[bool] = []  # per row: whether the last generated turn ended with a stop id
    self.tokens: list[list[int]] = []  # per row: every token id in its cache, in order
    self.generated_tokens = 0

  def reset(self, num_rows: int) -> None:
    super().reset(num_rows)
    if self.cache is None or self.cache.batch_size != num_rows:
      self.cache = self.sampler.init_cache(num_rows)
    self.cache = self.cache.with_lengths(np.zeros(num_rows, np.int32))
    self.logits = self.sampler.empty_logits(num_rows)
    self.closed = [True] * num_rows
    self.tokens = [[] for _ in range(num_rows)]

  def _tokens_for(self, r: SimRequest) -> list[int]:
    ids: list[int] = []
    if len(self._histories[r.row]) > len(r.new_messages):  # not the first call: close the last turn
      ids += ([] if self.closed[r.row] else [self.chat.im_end]) + self.chat.encode("\n")
    for m in r.new_messages:
      ids += self.chat.message(m["role"], m["content"])
    return ids + self.chat.generation_header()

  def generate(self, requests: Sequence[SimRequest]) -> list[str]:
    self._extend(requests)
    B = self.cache.batch_size
    rows = [[] for _ in range(B)]
    active = np.zeros(B, bool)
    for r in requests:
      rows[r.row] = self._tokens_for(r)
      self.tokens[r.row] += rows[r.row]
      active[r.row] = True
    try:
      self.cache, self.logits = self.sampler.append(self.params, self.cache, rows, self.logits)
    except ValueError as e:
      raise SimulatorBackendError(f"simulator context full ({e}); raise simulator.max_context") from e
    self.rng, key = jax.random.split(self.rng)
    res = self.sampler.decode(self.params, self.cache, self.logits, rng=key,
                              max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                              active=active)
    self.cache = res.cache
    out = []
    for r in requests:
      ids = res.row(r.row)
      self.tokens[r.row] += ids
      self.closed[r.row] = bool(res.stopped[r.row])
      self.generated_tokens += len(ids)
      text = self.chat.decode(ids, skip_special_tokens=True).strip()
      self._answer(r.row, text)
      out.append(text)
    return out
