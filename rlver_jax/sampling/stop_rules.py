"""Token-level stop rules checked inside the decode loop, as traced arrays (new contents never recompile).

Shapes: B rows, S stop sequences of up to L tokens, G gate sequences of up to Lg tokens, V vocabulary.

Two rules end a row early; either may be absent:
- **Stop sequences** `seqs` [B, S, L]: the row ends once its last generated tokens equal one of its
  sequences. Sequences are right-aligned; `PAD` (-1) fills the left and matches anything, and an
  all-`PAD` sequence is an unused slot (it never matches).
- **Line rule** (`gates` [B, G, Lg], `classes` [V], `content_bit` [B]): a row with `content_bit` != 0
  ends at the first token holding a line break (`classes & LINE_BREAK`) that comes after one of its
  gate sequences (e.g. the tokens of "Change:") and after at least one token with that content bit
  (the line's text). So a labelled line ends the answer once it is complete, whatever its text is,
  which no fixed token sequence could say.

Only tokens generated in the same decode call count (nothing before it). The stopping token is
kept: the row's generated tokens and its cache end with it, exactly as a longer decode truncated
there. Table sizes are padded to powers of two, so a new set of sequences of about the same size
compiles nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

PAD = -1
LINE_BREAK = 1  # bit of `classes`: the token's text holds a line break
_MIN_ROWS, _MIN_LEN = 8, 4


def _pow2(n: int, floor: int) -> int:
  size = floor
  while size < n:
    size *= 2
  return size


def sequence_table(per_row: Sequence[Sequence[Sequence[int]]], rows: int | None = None, *,
                   min_count: int = _MIN_ROWS, min_len: int = _MIN_LEN) -> np.ndarray:
  """[B, S, L] int32, each row's token sequences right-aligned and PAD-filled (S, L powers of two)."""
  B = len(per_row) if rows is None else rows
  if len(per_row) > B:
    raise ValueError(f"{len(per_row)} rows of stop sequences for {B} rows")
  for b, seqs in enumerate(per_row):
    for s in seqs:
      if len(s) == 0 or min(s) < 0:
        raise ValueError(f"row {b}: stop sequence {list(s)} must be non-empty token ids >= 0")
  S = _pow2(max([len(s) for s in per_row] + [1]), min_count)
  L = _pow2(max([len(q) for s in per_row for q in s] + [1]), min_len)
  table = np.full((B, S, L), PAD, np.int32)
  for b, seqs in enumerate(per_row):
    for i, q in enumerate(seqs):
      table[b, i, L - len(q):] = q
  return table


@dataclasses.dataclass(frozen=True)
class StopRules:
  """The stop rules of one decode call (host arrays; `Sampler.decode` moves them to the device)."""
  seqs: np.ndarray         # [B, S, L] int32 stop sequences (PAD-filled)
  gates: np.ndarray        # [B, G, Lg] int32 gate sequences of the line rule (PAD-filled)
  classes: np.ndarray      # [V] uint8 token bits: LINE_BREAK and the content bits
  content_bit: np.ndarray  # [B] int32 per row: the content bit of its line rule (0: no line rule)

  @staticmethod
  def make(rows: int, vocab: int, *, seqs: Sequence[Sequence[Sequence[int]]] = (),
           gates: Sequence[Sequence[Sequence[int]]] = (), classes: np.ndarray | None = None,
           content_bit: Sequence[int] | None = None) -> "StopRules":
    """Rules for `rows` rows; `seqs` / `gates` list each row's sequences (missing rows: none)."""
    classes = np.zeros(vocab, np.uint8) if classes is None else np.asarray(classes, np.uint8)
    if classes.shape != (vocab,):
      raise ValueError(f"classes has shape {classes.shape}; the vocabulary needs ({vocab},)")
    bits = np.zeros(rows, np.int32) if content_bit is None else np.asarray(content_bit, np.int32)
    if bits.shape != (rows,) or (bits & LINE_BREAK).any() or (bits < 0).any():
      raise ValueError(f"content_bit must be ({rows},) non-negative bits other than LINE_BREAK, "
                       f"got {bits.tolist()}")
    return StopRules(seqs=sequence_table(seqs, rows), gates=sequence_table(gates, rows),
                     classes=classes, content_bit=bits)

  @property
  def rows(self) -> int:
    return self.seqs.shape[0]

  def check(self, rows: int, vocab: int) -> None:
    """One line naming the mismatch, before anything runs on device."""
    if self.seqs.shape[0] != rows or self.gates.shape[0] != rows or self.content_bit.shape != (rows,):
      raise ValueError(f"stop rules for {self.seqs.shape[0]} rows; the cache has {rows}")
    if self.classes.shape != (vocab,):
      raise ValueError(f"stop rules' classes cover {self.classes.shape[0]} tokens; the model has {vocab}")
    for name, table in (("seqs", self.seqs), ("gates", self.gates)):
      if (table >= vocab).any() or (table < PAD).any():
        raise ValueError(f"stop rules' {name} hold ids outside the vocabulary [0, {vocab})")

  def device(self) -> "StopTables":
    return StopTables(seqs=jnp.asarray(self.seqs), gates=jnp.asarray(self.gates),
                      classes=jnp.asarray(self.classes), content_bit=jnp.asarray(self.content_bit))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StopTables:
  """`StopRules` as device arrays (traced arguments of the decode program)."""
  seqs: jax.Array
  gates: jax.Array
  classes: jax.Array
  content_bit: jax.Array

  def start(self) -> "StopState":
    B = self.seqs.shape[0]
    width = max(self.seqs.shape[2], self.gates.shape[2])
    false = jnp.zeros((B,), bool)
    return StopState(recent=jnp.full((B, width), PAD, jnp.int32), armed=false, ready=false, hit=false)


def _ends_with_any(recent_BxW, table_BxSxL) -> jax.Array:
  """[B] bool: the row's recent tokens end with one of its sequences (PAD matches anything)."""
  L = table_BxSxL.shape[2]
  tail = recent_BxW[:, None, -L:]
  same = (table_BxSxL == tail) | (table_BxSxL == PAD)
  used = jnp.any(table_BxSxL != PAD, axis=-1)
  return jnp.any(jnp.all(same, axis=-1) & used, axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StopState:
  """Per-row progress through the rules, carried by the decode loop."""
  recent: jax.Array  # [B, W] int32 the last W generated tokens, right-aligned, PAD before the first
  armed: jax.Array   # [B] bool: a gate sequence was generated
  ready: jax.Array   # [B] bool: and a content token after it
  hit: jax.Array     # [B] bool: the row ended on a rule

  def advance(self, tables: StopTables, tok_B, live_B) -> tuple["StopState", jax.Array]:
    """Takes each live row's new token; returns the new state and [B] bool "stop here"."""
    recent = jnp.where(live_B[:, None],
                       jnp.concatenate([self.recent[:, 1:], tok_B[:, None]], axis=1), self.recent)
    bits = tables.classes[tok_B].astype(jnp.int32)
    has_rule = tables.content_bit > 0
    ready = self.ready | (self.armed & live_B & ((bits & tables.content_bit) != 0))
    line_end = has_rule & ready & ((bits & LINE_BREAK) != 0)
    stop = (_ends_with_any(recent, tables.seqs) | line_end) & live_B
    armed = self.armed | (has_rule & _ends_with_any(recent, tables.gates) & live_B)
    return StopState(recent=recent, armed=armed, ready=ready, hit=self.hit | stop), stop
