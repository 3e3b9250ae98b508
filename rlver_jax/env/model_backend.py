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
    self.closed: list[bool] = []  # per row: whether the last generated turn ended with <|im_end|>
    self.tokens: list[list[int]] = []  # per row: every token id in its cache, in order
    self.full: list[bool] = []  # per row: a request did not fit; the row answers "" from then on
    self.generated_tokens = 0

  def reset(self, num_rows: int) -> None:
    super().reset(num_rows)
    rows = self.sampler.padded_rows(num_rows)  # inactive rows up to a fully sharded batch
    if self.cache is None or self.cache.batch_size != rows:
      self.cache = None  # freed before the new one is allocated: at 72B each is tens of GiB a chip
      self.cache = self.sampler.init_cache(rows)
    self.cache = self.cache.with_lengths(np.zeros(rows, np.int32))
    self.logits = self.sampler.empty_logits(rows)
    self.closed = [True] * num_rows
    self.tokens = [[] for _ in range(num_rows)]
    self.full = [False] * num_rows

  def is_full(self, row: int) -> bool:
    return self.full[row]

  def reseed(self, key: jax.Array) -> None:
    """Sets the sampling key; the trainer derives it from the run's state so a resume repeats it."""
    self.rng = key

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
      ids = self._tokens_for(r)
      # The new messages plus a whole answer must fit; a row that cannot is full from now on and its
      # dialogue ends (SimulatedUsers marks it context_full), like a policy row out of cache.
      if self.full[r.row] or len(self.tokens[r.row]) + len(ids) + self.max_new_tokens > self.sampler.max_len:
        if r.kind == "opening":
          raise SimulatorBackendError(
              f"the simulator's first prompt ({len(ids)} tokens) plus max_new_tokens="
              f"{self.max_new_tokens} exceeds simulator.max_context={self.sampler.max_len}")
        self.full[r.row] = True
        continue
      rows[r.row] = ids
      self.tokens[r.row] += ids
      active[r.row] = True
    res = None
    if active.any():
      self.cache, self.logits = self.sampler.append(self.params, self.cache, rows, self.logits)
      self.rng, key = jax.random.split(self.rng)
      res = self.sampler.decode(self.params, self.cache, self.logits, rng=key,
                                max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                                active=active)
      self.cache = res.cache
    out = []
    for r in requests:
      if self.full[r.row]:
        self._answer(r.row, "")
        out.append("")
        continue
      ids = res.row(r.row)
      self.tokens[r.row] += ids
      # Only <|im_end|> closes a turn; one cut short or ended by <|endoftext|> gets it appended next.
      self.closed[r.row] = ids[-1:] == [self.chat.im_end]
      self.generated_tokens += len(ids)
      text = self.chat.decode(ids, skip_special_tokens=True).strip()
      self._answer(r.row, text)
      out.append(text)
    return out
