"""The co-located simulator backend: a Qwen2-family model on the same mesh, run by our sampler.

All live dialogues are generated as one batch. Each row keeps its KV cache across calls: a call
appends only the row's new messages (ChatML fragments) plus an assistant header, then decodes. The
simulator's context is therefore append-only and never re-prefilled. `rewind` sets a row back to
the end of one of its earlier messages (the reference information flow drops each step's private
answers that way) and `prefill` appends messages without generating.

`rows` (rollout.rows) bounds the cache rows: a dialogue takes a cache row ("slot") at its first use
and holds it until `release`; every method addresses dialogues, `_slot` maps them to cache rows.
Each dialogue then samples from its own key stream (`scheduler.dialogue_keys`), so its answers do
not depend on its slot or on the other dialogues. Without it dialogue d is slot d and each decode
draws from one key (the lockstep rollout).

With a draft (`sampling.speculative`, config.simulator.draft_checkpoint) a second cache holds the
same tokens in the draft model: every append, row copy and rewind goes to both, and decodes are
draft-and-verify; `take_draft_metrics` reports the draft's acceptance since the last take.
"""
from __future__ import annotations

from typing import Sequence

from rlver_jax.env.backends import Message

import jax
import numpy as np

from rlver_jax.env.answer_stops import AnswerStops
from rlver_jax.env.backends import HistoryBackend, SimRequest, SimulatorBackendError
from rlver_jax.env.expected_change import ChangeScorer
from rlver_jax.env.scheduler import RowSlots, dialogue_keys
from rlver_jax.models.tokenizer import ChatTokens
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.speculative import DraftCounts, SpeculativeSampler
from rlver_jax.sampling.strategies import SamplingParams
from rlver_jax.parallel.sharding import host_array


class ModelBackend(HistoryBackend):
  """Simulated-user text from a local model; `generate` batches all requested rows."""

  scores_changes = True  # its own distribution over the change values (expected_change)

  def __init__(self, sampler: Sampler, params, chat: ChatTokens, *, max_new_tokens: int,
               sampling: SamplingParams, seed: int = 0, share_prefix: bool = True,
               stop_at_lines: bool = False, rows: int = 0, draft: Sampler | None = None,
               draft_params=None, draft_tokens: int = 4):
    """`share_prefix`: `clone_rows` copies KV rows (True) or prefills the copied tokens again.
    `stop_at_lines`: each answer's decode ends with its change / reply line (`answer_stops`).
    `rows`: at most this many cache rows, lent to dialogues while they run (0: one per dialogue).
    `draft`: a sampler of a model with the same vocabulary that proposes `draft_tokens` tokens
    per verify pass (its params `draft_params`); None: plain decodes."""
    super().__init__()
    if rows < 0:
      raise ValueError(f"rollout.rows={rows}: must be >= 0 (0 = a cache row per dialogue)")
    self.rows = rows
    self.slots: RowSlots | None = None
    self.calls: list[int] = []  # per dialogue: generations so far (its key stream's position)
    self._base = None  # with lent rows: this batch's base key of the dialogue streams
    self.stops = AnswerStops(chat, sampler.config.vocab_size) if stop_at_lines else None
    self.share_prefix = share_prefix
    self.prefill_tokens = 0  # tokens run through the model as input (not sampled), all calls
    # Answers that reached max_new_tokens unclosed: a cut emotion step has no change line (0).
    self.cut_answers = 0
    self.sampler = sampler
    self.params = params
    self.chat = chat
    self.max_new_tokens = max_new_tokens
    self.sampling = sampling
    self.rng = jax.random.key(seed)
    self.cache = None
    self.logits = None
    self.spec = None if draft is None else SpeculativeSampler(sampler, draft, draft_tokens)
    self.draft_params = draft_params
    self.draft_cache = None
    self._draft_counts = DraftCounts()
    self.closed: list[bool] = []  # per row: whether the last generated turn ended with <|im_end|>
    self.tokens: list[list[int]] = []  # per row: every token id in its cache, in order
    self.full: list[bool] = []  # per row: a request did not fit; the row answers "" from then on
    self.answered: list[bool] = []  # per row: it ends in a generated answer, closed by the next call
    # Per row: message count -> cached tokens where that many messages end (rewind targets).
    self.ends: list[dict[int, int]] = []
    self.answers: list[tuple[int, int]] = []  # per row: (start, end) of its last answer in `tokens`
    self.generated_tokens = 0
    self._changes = ChangeScorer(chat)

  def reset(self, num_rows: int) -> None:
    super().reset(num_rows)
    lent = min(self.rows, num_rows) if self.rows else num_rows
    self.slots = RowSlots(lent) if self.rows and num_rows else None
    self.calls = [0] * num_rows
    if self.slots is not None:  # this batch's streams, new even without a reseed
      self.rng, self._base = jax.random.split(self.rng)
    rows = self._padded_rows(lent)  # inactive rows up to a fully sharded batch
    if self.cache is None or self.cache.batch_size != rows:
      self.cache = self.draft_cache = None  # freed first: at 72B each is tens of GiB a chip
      self.cache = self.sampler.init_cache(rows)
      if self.spec is not None:
        self.draft_cache = self.spec.draft.init_cache(rows)
    self._set_lengths(np.zeros(rows, np.int32))
    self.logits = self.sampler.empty_logits(rows)
    self.closed = [True] * num_rows
    self.tokens = [[] for _ in range(num_rows)]
    self.full = [False] * num_rows
    self.answered = [False] * num_rows
    self.ends = [{} for _ in range(num_rows)]
    self.answers = [(0, 0)] * num_rows

  def _padded_rows(self, lent: int) -> int:
    """Cache rows that the simulator's mesh (and its draft's) shard fully."""
    return (self.spec or self.sampler).padded_rows(lent)

  def _set_lengths(self, lengths: np.ndarray) -> None:
    """Rewinds (or resets) every cache row to `lengths`, the draft's too."""
    self.cache = self.cache.with_lengths(lengths)
    if self.spec is not None:
      self.draft_cache = self.draft_cache.with_lengths(lengths)

  def _append(self, rows: list[list[int]]) -> None:
    if self.spec is None:
      self.cache, self.logits = self.sampler.append(self.params, self.cache, rows, self.logits)
      return
    (self.cache, self.draft_cache), self.logits = self.spec.append(
        self.params, self.draft_params, (self.cache, self.draft_cache), rows, self.logits)

  def _copy_rows(self, slots: dict[int, int]) -> None:
    if self.spec is None:
      self.cache, self.logits = self.sampler.copy_rows(self.cache, self.logits, slots)
      return
    (self.cache, self.draft_cache), self.logits = self.spec.copy_rows(
        (self.cache, self.draft_cache), self.logits, slots)

  def _decode(self, rng, active: np.ndarray, rules):
    kw = dict(rng=rng, max_new_tokens=self.max_new_tokens, sampling=self.sampling, active=active,
              stop_rules=rules)
    if self.spec is None:
      return self.sampler.decode(self.params, self.cache, self.logits, **kw)
    out = self.spec.decode(self.params, self.draft_params, (self.cache, self.draft_cache),
                           self.logits, **kw)
    self.draft_cache = out.draft_cache
    self._draft_counts.add(out)
    return out.decode

  def take_draft_metrics(self) -> dict[str, float]:
    """`simulator/draft_acceptance` (kept / proposed draft tokens) and `simulator/tokens_per_verify`
    (generated tokens / target passes) since the last take, then zeroed; {} without a draft."""
    if self.spec is None:
      return {}
    return {f"simulator/{k}": v for k, v in self._draft_counts.take().items()}

  def is_full(self, row: int) -> bool:
    return self.full[row]

  def release(self, row: int) -> None:
    if self.slots is not None and row in self.slots.row_of:
      self.slots.release(row)

  def _slot(self, row: int) -> int:
    """The cache row of dialogue `row` (lent at its first use)."""
    if self.slots is None:
      return row
    held = self.slots.row_of.get(row)
    if held is None:  # a lent row starts empty, whatever the dialogue before it left there
      held = self.slots.take(row)
      lengths = host_array(self.cache.lengths).copy()
      lengths[held] = 0
      self._set_lengths(lengths)
    return held

  def clone_rows(self, sources: dict[int, int]) -> None:
    """Copies the rows' contexts and KV cache rows: the copies' shared prefix is computed once."""
    super().clone_rows(sources)
    slots = {self._slot(dst): self._slot(src) for dst, src in sources.items()}
    if self.share_prefix:
      self._copy_rows(slots)
    else:  # the same tokens, computed again for each copy
      rows = [[] for _ in range(self.cache.batch_size)]
      lengths = host_array(self.cache.lengths).copy()
      for dst, src in sources.items():
        rows[self._slot(dst)], lengths[self._slot(dst)] = self.tokens[src], 0
        self.prefill_tokens += len(self.tokens[src])
      self._set_lengths(lengths)
      self._append(rows)
    for dst, src in sources.items():
      self.tokens[dst] = list(self.tokens[src])
      self.closed[dst], self.full[dst] = self.closed[src], self.full[src]
      self.answered[dst], self.ends[dst] = self.answered[src], dict(self.ends[src])
      self.answers[dst] = self.answers[src]
      self.calls[dst] = self.calls[src]

  def reseed(self, key: jax.Array) -> None:
    """Sets the sampling key; the trainer derives it from the run's state so a resume repeats it."""
    self.rng = key

  def _message_tokens(self, row: int, messages: Sequence[Message]) -> tuple[list[int], dict[int, int]]:
    """The tokens that append `messages` (already in the row's history) to the row: the last answer's
    close, then each message; and where each message ends, as offsets into those tokens."""
    ids: list[int] = []
    if self.answered[row]:  # close the last generated turn
      ids += ([] if self.closed[row] else [self.chat.im_end]) + self.chat.encode("\n")
    before = len(self._histories[row]) - len(messages)
    ends = {before: len(ids)}
    for i, m in enumerate(messages):
      ids += self.chat.message(m["role"], m["content"])
      ends[before + i + 1] = len(ids)
    return ids, ends

  def _take(self, row: int, ids: list[int], ends: dict[int, int]) -> None:
    """Records `ids` as appended to the row (the caller writes them to the cache)."""
    self.ends[row].update({n: len(self.tokens[row]) + at for n, at in ends.items()})
    self.tokens[row] += ids
    self.prefill_tokens += len(ids)

  def _fits(self, row: int, ids: list[int]) -> bool:
    """Whether `ids` and a whole answer after them fit in the row's cache."""
    return not self.full[row] and len(self.tokens[row]) + len(ids) + self.max_new_tokens <= self.sampler.max_len

  def prefill(self, messages: dict[int, Sequence[Message]]) -> None:
    """Appends the messages to the rows' caches without generating; a row they do not fit (with room
    for an answer) is full from now on."""
    super().prefill(messages)
    rows = [[] for _ in range(self.cache.batch_size)]
    for row, new in messages.items():
      ids, ends = self._message_tokens(row, new)
      if not self._fits(row, ids):
        self.full[row] = True
        continue
      rows[self._slot(row)] = ids
      self._take(row, ids, ends)
      self.answered[row] = False
    if any(rows):
      self._append(rows)

  def rewind(self, keep: dict[int, int]) -> None:
    """Sets each row back to where its first `keep[row]` messages end (its cache length, tokens and
    history); the slots after it are overwritten by the next append."""
    for row, n in keep.items():
      if n not in self.ends[row]:
        raise ValueError(f"row {row}: cannot rewind to {n} messages: they do not end at a message "
                         "boundary in its cache (inside a generated answer not yet closed, or unsent)")
    super().rewind(keep)
    lengths = host_array(self.cache.lengths).copy()
    for row, n in keep.items():
      lengths[self._slot(row)] = self.ends[row][n]
      del self.tokens[row][self.ends[row][n]:]
      self.ends[row] = {m: at for m, at in self.ends[row].items() if m <= n}
      self.answered[row], self.closed[row] = False, True
    self._set_lengths(lengths)

  def generate(self, requests: Sequence[SimRequest]) -> list[str]:
    self._extend(requests)
    B = self.cache.batch_size
    rows = [[] for _ in range(B)]
    active = np.zeros(B, bool)
    for r in requests:
      ids, ends = self._message_tokens(r.row, r.new_messages)
      ids += self.chat.generation_header()
      # The new messages plus a whole answer must fit; a row that cannot is full from now on and its
      # dialogue ends (SimulatedUsers marks it context_full), like a policy row out of cache.
      if not self._fits(r.row, ids):
        if r.kind == "opening":
          raise SimulatorBackendError(
              f"the simulator's first prompt ({len(ids)} tokens) plus max_new_tokens="
              f"{self.max_new_tokens} exceeds simulator.max_context={self.sampler.max_len}")
        self.full[r.row] = True
        continue
      rows[self._slot(r.row)] = ids
      self._take(r.row, ids, ends)
      active[self._slot(r.row)] = True
    res = None
    if active.any():
      self._append(rows)
      rules = None if self.stops is None else self.stops.rules(
          {self._slot(r.row): r.kind for r in requests if not self.full[r.row]}, B)
      res = self._decode(self._keys(requests), active, rules)
      self.cache = res.cache
    out = []
    for r in requests:
      if self.full[r.row]:
        self._answer(r.row, "")
        out.append("")
        continue
      ids = res.row(self._slot(r.row))
      self.answers[r.row] = (len(self.tokens[r.row]), len(self.tokens[r.row]) + len(ids))
      self.tokens[r.row] += ids
      # Only <|im_end|> closes a turn; one cut short, ended by a stop rule or by <|endoftext|> gets
      # it appended next.
      self.closed[r.row] = ids[-1:] == [self.chat.im_end]
      self.cut_answers += len(ids) >= self.max_new_tokens and not self.closed[r.row]
      self.answered[r.row] = True
      self.generated_tokens += len(ids)
      text = self.chat.decode(ids, skip_special_tokens=True).strip()
      self._answer(r.row, text)
      out.append(text)
    return out

  def expected_changes(self, value_offsets: dict[int, int]) -> dict[int, float]:
    """Per row, the expected change at `value_offsets[row]`, a character offset into the text of
    the row's last answer (see expected_change); the cache is left as it is."""
    answers, dialogue = {}, {}
    for row, offset in value_offsets.items():
      start, end = self.answers[row]
      slot = self._slot(row)
      answers[slot], dialogue[slot] = (self.tokens[row][:end], start, offset), row
    scores = self._changes.expected(self.sampler, self.params, self.cache, answers)
    return {dialogue[slot]: change for slot, change in scores.items()}

  def _keys(self, requests: Sequence[SimRequest]) -> jax.Array:
    """One key for the call, or with lent rows each slot's own: a dialogue's n-th generation draws
    from the batch's base key folded with its id and n, wherever and with whomever it runs."""
    if self.slots is None:
      self.rng, key = jax.random.split(self.rng)
      return key
    holders = self.slots.holders(self.cache.batch_size)
    counts = [0 if d is None else self.calls[d] for d in holders]
    for r in requests:
      self.calls[r.row] += 1
    return dialogue_keys(self._base, holders, counts)
