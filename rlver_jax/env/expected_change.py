"""The expected emotion change (`simulator.change_mode="expected"`): the co-located simulator's own
distribution over the allowed change values, read where its analysis writes the value.

After the analysis is sampled as usual, every value v in [-MAX_CHANGE, MAX_CHANGE] (the range the
emotion prompt allows, whatever `simulator.clamp_change`) is teacher-forced at the position of the
written value, in each way the parser reads as v: "+3" and "3", "-4", "0" / "+0" / "-0". All of them
go through one cached forward pass over the row's KV cache (`sampling.branches`, a tree of
continuations that writes nothing). A form's probability is its tokens' probability times that of no
digit coming next (else "+1" would also count "+10"); a value's is the sum over its forms, normalised
over the allowed values; the change is the mean of that distribution. So the reward keeps the same
verifiable reasoning (the sampled analysis) without the noise of sampling the number itself.

Decisions:
- The mean is not rounded: the emotion becomes a float and the reward stays final emotion / 100
  (turn rewards: emotion differences / 100, summing to (final - start) / 100). Rounding would put
  back a step function of the analysis and hide small differences between replies.
- The text keeps the sampled value. The cache, the transcript's reasoning and what the reply step's
  context holds are the tokens the simulator wrote (what followed the value was conditioned on it);
  the reply instruction states the emotion after the expected change, to one decimal.
- The distribution is conditional on a plain number being written there: worded directions ("up 3"),
  other minus signs and decimals are not scored. An analysis without a readable value keeps the
  sampled path's rule (no change, re-asked like today).

Token positions: the value's character offset in the answer text (`parsing.change_value_offset`) is
mapped to the longest run of answer tokens whose text ends at or before it; the characters between
that run and the value (a space a token like " +" had merged in) are prefixed to every form.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from rlver_jax.env.parsing import MAX_CHANGE
from rlver_jax.models.tokenizer import ChatTokens
from rlver_jax.sampling.branches import BranchQuery, score_branches
from rlver_jax.sampling.kv_cache import KVCache
from rlver_jax.sampling.sampler import Sampler

CHANGE_MODES = ("sampled", "expected")
CHANGE_VALUES = tuple(range(-MAX_CHANGE, MAX_CHANGE + 1))
_DIGITS = "0123456789０１２３４５６７８９"


def value_forms(value: int) -> tuple[str, ...]:
  """The plain spellings the change parser reads as `value`."""
  if value > 0:
    return (f"+{value}", f"{value}")
  if value < 0:
    return (f"-{-value}",)
  return ("0", "+0", "-0")


def expected_value(value_logp: dict[int, float]) -> float | None:
  """The mean of the values under their (unnormalised) log-probabilities; None if all are -inf."""
  values = np.array(list(value_logp), np.float64)
  logp = np.array(list(value_logp.values()), np.float64)
  if not np.isfinite(logp).any():
    return None
  weights = np.exp(logp - logp.max())
  return float((values * weights).sum() / weights.sum())


def split_at(chat: ChatTokens, ids: Sequence[int], offset: int) -> tuple[int, str]:
  """(k, gap): the first k answer tokens decode to the text before `offset` up to `gap`, the
  characters left between them and the offset. `offset` counts in the answer's stripped text, as
  the simulator parsed it."""
  raw = chat.decode(ids)
  at = len(raw) - len(raw.lstrip()) + offset
  for k in range(len(ids), -1, -1):  # the value sits near the end: few decodes
    head = chat.decode(ids[:k])
    if len(head) <= at and raw.startswith(head):
      return k, raw[len(head):at]
  return 0, raw[:at]


class ChangeScorer:
  """Expected changes for a model backend's rows (token ids of each form cached by gap)."""

  def __init__(self, chat: ChatTokens):
    self.chat = chat
    self._forms: dict[str, tuple[list[int], tuple[tuple[int, ...], ...]]] = {}
    self._digit_ids: list[int] | None = None

  def digit_ids(self) -> list[int]:
    """Ids of the tokens whose text starts with a digit: one of them next would extend a number."""
    if self._digit_ids is None:
      tokenizer = self.chat.tokenizer
      pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
      self._digit_ids = [i for i, p in enumerate(pieces) if p and p[0] in _DIGITS]
    return self._digit_ids

  def forms_after(self, gap: str) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
    """(the value of each branch, the branches' token ids) for a value written after `gap`."""
    if gap not in self._forms:
      values, branches = [], []
      for v in CHANGE_VALUES:
        for form in value_forms(v):
          values.append(v)
          branches.append(tuple(self.chat.encode(gap + form)))
      self._forms[gap] = (values, tuple(branches))
    return self._forms[gap]

  def expected(self, sampler: Sampler, params, cache: KVCache,
               answers: dict[int, tuple[list[int], int, int]]) -> dict[int, float]:
    """Per row, the expected change. `answers[row]` = (the row's cached token ids, where its last
    answer starts among them, the character offset of the written value in that answer's text).
    A row whose distribution underflows everywhere is left out (its sampled value stands)."""
    queries, values = {}, {}
    for row, (tokens, start, offset) in answers.items():
      k, gap = split_at(self.chat, tokens[start:], offset)
      values[row], branches = self.forms_after(gap)
      prefix = start + k
      queries[row] = BranchQuery(prefix_len=prefix, root=tokens[prefix - 1], branches=branches)
    scores = score_branches(sampler, params, cache, queries, extend_ids=self.digit_ids())
    out = {}
    for row, logp in scores.items():
      per_value = {}
      for v, lp in zip(values[row], logp):
        per_value[v] = np.logaddexp(per_value.get(v, -np.inf), lp)
      mean = expected_value(per_value)
      if mean is not None:
        out[row] = mean
    return out
