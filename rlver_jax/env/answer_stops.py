"""Where a generated answer may end early: the simulator's change and reply lines, the policy's
end-of-turn strings, as the sampler's on-device stop rules (`sampling.stop_rules`).

The emotion step ends at the end of the first line after a change label ("Change:", "**变化：**")
that has text on it; the reply step (and the opening) likewise after a reply label. That is the
line `parsing` reads for that label, so the kept text parses as the whole answer would whenever
the model writes no further label of the same kind after it (the prompts ask for the labelled line
last; `parsing` reads the last label, so a later one would have won).

Token boundaries: a string can be split across tokens in many ways, so nothing here matches the
line as a string. The label is matched as a token sequence, listed for every tokenization the
tokenizer gives it in the contexts where a model writes it (line start, after a space or "**",
colon variants), and the line's end is any token whose text holds a line break (Qwen2.5 has about
2,200 such tokens: "\\n", ".\\n", "**\\n\\n", ...), classified once from the vocabulary. A token
with text after its line break (none in the BPE vocabularies used here) is no line end, so a stop
never cuts into the next line. A label the model spells another way is not matched: that answer
just decodes to its end as before. A label token glued to a word before it ("hiReply:", which the
parser does not read as a label) does arm the rule; BPE tokenizers rarely split text that way.
"""
from __future__ import annotations

import functools
from typing import Mapping, Sequence

import numpy as np

from rlver_jax.env.parsing import CHANGE_STRIP, LINE_BREAKS, REPLY_STRIP
from rlver_jax.models.tokenizer import ChatTokens
from rlver_jax.sampling.stop_rules import LINE_BREAK, StopRules

CHANGE_CONTENT, REPLY_CONTENT = 2, 4  # content bits: a character the change / reply parser keeps
CHANGE_LABELS = ("Change", "change", "CHANGE", "变化", "变化值", "变化量")
REPLY_LABELS = ("Reply", "reply", "REPLY", "回复")
_BEFORE = ("\n", " ", "\n**", " **", "**", "\n- ", "\n### ")
_COLONS = (":", "：", " :", ":**", "**:", "：**", "**：")
_AFTER = {"change": (" +3", "+3", " -4", " 0", "\n+3", "\n\n+3", " **+3"),
          "reply": (" I", "\nI", "\n\nI", " \"I", " **I")}
# Which rule each simulator request kind gets (simulator.SimulatedUsers names them).
KIND_RULE = {"emotion": "change", "retry": "change", "reply": "reply", "reply_retry": "reply",
             "opening": "reply"}


def token_classes(chat: ChatTokens, vocab_size: int) -> np.ndarray:
  """[vocab_size] uint8 bits per token: LINE_BREAK (text holds a line break and only blanks after
  it), CHANGE_CONTENT / REPLY_CONTENT (text before any line break keeps a character after the
  change / reply parser's stripping). Ids past the tokenizer's vocabulary get 0."""
  n = min(len(chat.tokenizer), vocab_size)
  texts = chat.tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
  out = np.zeros(vocab_size, np.uint8)
  breaks = set(LINE_BREAKS)
  for i, text in enumerate(texts):
    cut = next((k for k, ch in enumerate(text) if ch in breaks), None)
    head = text if cut is None else text[:cut]
    bits = 0
    if cut is not None and not text[cut:].strip():
      bits |= LINE_BREAK
    if head.strip(CHANGE_STRIP):
      bits |= CHANGE_CONTENT
    if head.strip(REPLY_STRIP):
      bits |= REPLY_CONTENT
    out[i] = bits
  return out


def _covering(chat: ChatTokens, before: str, label: str, after: str) -> tuple[int, ...] | None:
  """The tokens of before+label+after that cover `label` (found by decoding prefixes)."""
  ids = chat.encode(before + label + after)
  start, end = len(before), len(before) + len(label)
  lengths = [len(chat.decode(ids[:k], skip_special_tokens=False)) for k in range(len(ids) + 1)]
  first = max(k for k in range(len(ids)) if lengths[k] <= start)
  last = min(k for k in range(1, len(ids) + 1) if lengths[k] >= end)
  unk = chat.tokenizer.unk_token_id
  gate = tuple(ids[first:last])
  return None if unk is not None and unk in gate else gate


@functools.lru_cache(maxsize=8)
def _gates(chat: ChatTokens, rule: str) -> tuple[tuple[int, ...], ...]:
  labels = CHANGE_LABELS if rule == "change" else REPLY_LABELS
  found = {_covering(chat, before, label + colon, after)
           for label in labels for colon in _COLONS for before in _BEFORE for after in _AFTER[rule]}
  return tuple(sorted(g for g in found if g))


class AnswerStops:
  """Builds each simulator decode's stop rules from the kinds of its requests."""

  def __init__(self, chat: ChatTokens, vocab_size: int):
    self.vocab_size = vocab_size
    self.classes = token_classes(chat, vocab_size)
    self.gates = {rule: [list(g) for g in _gates(chat, rule)] for rule in ("change", "reply")}

  def rules(self, kinds: Mapping[int, str], rows: int) -> StopRules:
    """Rules for a cache of `rows` rows; `kinds` maps each decoding row to its request kind."""
    gates: list[list[list[int]]] = [[] for _ in range(rows)]
    bits = np.zeros(rows, np.int32)
    for row, kind in kinds.items():
      rule = KIND_RULE.get(kind)
      if rule is None:
        continue
      gates[row] = self.gates[rule]
      bits[row] = CHANGE_CONTENT if rule == "change" else REPLY_CONTENT
    return StopRules.make(rows, self.vocab_size, gates=gates, classes=self.classes, content_bit=bits)


def sequence_stops(chat: ChatTokens, strings: Sequence[str], rows: int, vocab_size: int) -> StopRules | None:
  """Rules ending every row at any of `strings` (a special token such as "<|im_start|>" is its one
  id; other text its tokenizer's own tokenization); None without strings."""
  if not strings:
    return None
  seqs = [list(chat.tokenizer.encode(s, add_special_tokens=False)) for s in strings]
  return StopRules.make(rows, vocab_size, seqs=[seqs] * rows)
