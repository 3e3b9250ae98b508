"""SAGE-style simulated user: per-dialogue emotion state machine and a batched driver.

Pure logic over text: the words come from a `SimulatorBackend`. Each dialogue's simulator context
is an append-only chat message list (see simulator_prompts for the texts):
  system  (role, goal, persona, background, hidden theme, style rules)
  user (asks for the opening line)  -> assistant (the opening; the profile's `first_talk` if any)
  per policy turn:
  user (policy reply, emotion, emotion-step instruction) -> assistant (analysis, "Change: +N")
  [user (correction: redo the analysis) -> assistant]  at most `max_parse_retries` times
  user (new state, reply-step instruction) -> assistant (plan ... "Reply: <text>")
  [user (correction: end with the reply line) -> assistant]  at most `max_parse_retries` times
Only the line of the last reply marker reaches the policy. An answer without one (or with nothing
after it) is re-asked like an unreadable change line; the text around that line is private
planning, so after the retries the user says nothing that turn (`_SILENT_REPLY`).

Rows are dialogue ids fixed at construction; every call addresses rows by id, never by position
among the live dialogues (the reference mixes up simulators once some dialogues end).
"""
from __future__ import annotations

import dataclasses
import operator
import re
from typing import Sequence

from rlver_jax.env import simulator_prompts as prompts
from rlver_jax.env.backends import Message, SimRequest, SimulatorBackend
from rlver_jax.env.chat import says_goodbye
from rlver_jax.env.profiles import Profile, personality_key

TERMINATIONS = ("goodbye", "emotion_zero", "emotion_full", "max_turns", "context_full")
MAX_CHANGE = 10

# A change label: "change"/"变化" followed by a colon (after optional markdown) or directly a number.
_CHANGE_LABEL = re.compile(
    r"(?:(?<![a-z])change(?![a-z])|变化(?:值|量|分数|分值)?)"
    r"[\s*_]*(?:[:：=]|(?=[+\-−－＋﹢﹣–±]?\s*[0-9０-９]))",
    re.IGNORECASE)
_SIGNS = "+\\-−－＋﹢﹣–±"
_MINUS = "-−－﹣–"
_FULLWIDTH_DIGITS = str.maketrans("０１２３４５６７８９", "0123456789")
# Markdown, quotes, opening brackets and spaces a model may wrap around the value.
_DECOR = " \t\u3000*_`\"'“”‘’「」([（【［"
# Direction words. Single characters (升, 减, ...) only count right before the number: after it
# they are too often part of another word (减轻 "eases" is good news).
_UP = r"上升|增加|提高|提升|上涨|升高|(?:up|plus|increase[sd]?|increasing|rise[sn]?|rose|rising)(?![a-z])"
_DOWN = (r"下降|减少|降低|下跌|(?:down|minus|decrease[sd]?|decreasing|drop(?:s|ped)?|"
         r"fall(?:s|en)?|fell|falling)(?![a-z])")
_WORD_BEFORE = re.compile(
    rf"(?:(?P<up>{_UP}|升|加|涨)|(?P<down>{_DOWN}|降|减|跌))(?:\s{{0,3}}(?:by|of)(?![a-z])|了)?",
    re.IGNORECASE)
_NUMBER = re.compile(rf"([{_SIGNS}]?)\s{{0,3}}([0-9０-９]+)(?:[.．]([0-9０-９]+))?")
_UNIT = r"(?:\s{0,3}(?:points?|pts?|分|点)(?![a-z]))?"
_WORD_AFTER = re.compile(rf"{_UNIT}[\s(（]{{0,3}}(?:(?P<up>{_UP})|(?P<down>{_DOWN}))", re.IGNORECASE)
# "30 to 35", "30→35", "30升到35": a before/after pair of emotion values, not a change.
_RANGE_AFTER = re.compile(
    rf"{_UNIT}\s{{0,3}}(?:(?:{_UP}|{_DOWN}|升|降)\s{{0,3}})?"
    rf"(?:→|->|=>|⟶|~|～|[-–—]|to(?![a-z])|到|至|变为|变成)\s{{0,3}}[{_SIGNS}]?\s{{0,3}}[0-9０-９]",
    re.IGNORECASE)
# A worded "no change" filling the whole value: read as 0 (the model did give its judgement).
_NO_CHANGE = re.compile(
    r"(?:none|no\s+change|unchanged|nothing|zero|无|无变化|没有变化|没变化|没变|不变|保持不变|零)",
    re.IGNORECASE)
_TRAILING_PUNCT = " \t\u3000*_`\"'“”‘’「」.。!！,，;；()（）"
_REPLY_LABEL = re.compile(r"(?:(?<![a-z])reply(?![a-z])|回复)[\s*_]*[:：]", re.IGNORECASE)
_MARKDOWN = " \t\u3000*_"
# Line breaks as str.splitlines sees them.
_LINE = re.compile("[^\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]*")
# Labels tried from the last one back: a bound keeps a huge answer made of labels linear.
_MAX_LABELS_TRIED = 16
_QUOTES = (('"', '"'), ("'", "'"), ("“", "”"), ("‘", "’"), ("「", "」"), ("『", "』"))


def parse_change(text: object) -> int | None:
  """The change stated after the last change label with a readable value, clamped to [-10, 10];
  None if no label has one.

  Labels are tried from the last one back (a later "change:" in prose does not hide the real
  line). Only a label's own line is read (or, when nothing follows the label there, the next
  non-blank line), and the value must come first on it: an optional sign and/or direction word,
  then the number. A decimal is rounded to the nearest integer, halves away from zero ("+2.5" is 3);
  "±0" is 0 ("±" with any other number is unreadable). Direction words mean + (上升/增加/up/plus/
  increase/rise, ...) or - (下降/减少/down/minus/decrease/drop/fall, ...); they may also follow the
  number ("3 points down", "3（下降）"). A sign that contradicts a direction word, an unsigned
  before/after pair ("30 to 35", "30→35", "从30到35"; "+3 -> 33" is the change +3) or any other text
  first is unreadable. A worded no-change filling the whole value ("none", "no change", "无", "不变",
  ...) is 0. Never raises: any input gives an int or None.
  """
  if not isinstance(text, str):
    return None
  for label in list(_CHANGE_LABEL.finditer(text))[::-1][:_MAX_LABELS_TRIED]:
    value = _first_filled_line(text, label.end(), _DECOR)
    if _NO_CHANGE.fullmatch(value.strip(_TRAILING_PUNCT)):
      return 0
    amount = _read_amount(value.strip(_DECOR))
    if amount is not None:
      return amount
  return None


def _first_filled_line(text: str, pos: int, strip: str) -> str:
  """The rest of the line at `pos`, else the first later line with more than `strip` characters."""
  while pos <= len(text):
    line = _LINE.match(text, pos).group()
    if line.strip(strip):
      return line
    pos += len(line) + 1  # past the break ("\r\n" just gives one more blank line)
  return ""


def _read_amount(value: str) -> int | None:
  """A signed and/or worded number at the start of `value` (see `parse_change`)."""
  directions = set()
  word = _WORD_BEFORE.match(value)
  if word:
    directions.add(1 if word.group("up") else -1)
    value = value[word.end():].lstrip(_DECOR)
  number = _NUMBER.match(value)
  if number is None:
    return None
  sign = number.group(1)
  # A sign marks the first number as a change, so "+3 -> 33" is +3; unsigned, it is a value.
  if not sign and _RANGE_AFTER.match(value, number.end()):
    return None
  if sign and sign != "±":
    directions.add(-1 if sign in _MINUS else 1)
  after = _WORD_AFTER.match(value, number.end())
  if after:
    directions.add(1 if after.group("up") else -1)
  if len(directions) > 1:  # e.g. "下降+3": which one did the model mean?
    return None
  # Zeros first, then the cut: long digit runs are far outside the clamp, and cutting them keeps
  # int() cheap and safe.
  digits = number.group(2).translate(_FULLWIDTH_DIGITS).lstrip("0")[:4]
  fraction = (number.group(3) or "0").translate(_FULLWIDTH_DIGITS)
  magnitude = int(digits or "0") + (fraction[0] >= "5")  # halves away from zero
  if sign == "±" and magnitude:
    return None  # "±3": no direction
  value = -magnitude if directions == {-1} else magnitude
  return max(-MAX_CHANGE, min(MAX_CHANGE, value))


def emotion_state(e: int) -> str:
  """S (>= 100), A (>= 70), B (>= 40), C (>= 10), F (< 10)."""
  if e >= 100:
    return "S"
  if e >= 70:
    return "A"
  if e >= 40:
    return "B"
  if e >= 10:
    return "C"
  return "F"


def apply_change(e: int, change: int) -> int:
  """The new emotion: clip(e + change, 0, 100)."""
  return max(0, min(100, e + change))


def _strip_quotes(text: str) -> str:
  text = text.strip()
  for left, right in _QUOTES:
    if len(text) >= 2 and text.startswith(left) and text.endswith(right):
      return text[len(left):-len(right)].strip()
  return text


# What a user "says" when the simulator gave no usable reply line even after the retries: the text
# before a marker is private planning (it may name the hidden theme) and must not reach the policy.
_SILENT_REPLY = {"en": "...", "zh": "……"}


def extract_reply(text: str) -> str | None:
  """The line of the last reply marker (or, when nothing follows the marker there, the next
  non-blank line), stripped of quotes; None when there is no marker or no such line. Nothing else
  is used: the text around that line is the user's planning or private notes."""
  markers = list(_REPLY_LABEL.finditer(text))
  if not markers:
    return None
  line = _first_filled_line(text, markers[-1].end(), _MARKDOWN)
  return _strip_quotes(line.strip(_MARKDOWN)) or None


@dataclasses.dataclass
class UserState:
  """Everything recorded about one dialogue.

  `emotions` starts with the start value and gains one entry per policy turn; `replies` starts with
  the opening line and gains one per generated user reply (none after a `max_turns` ending).
  """
  row: int
  profile: Profile
  language: str
  emotion: int
  emotions: list[int] = dataclasses.field(default_factory=list)
  changes: list[int] = dataclasses.field(default_factory=list)
  parsed: list[bool] = dataclasses.field(default_factory=list)
  reasoning: list[str] = dataclasses.field(default_factory=list)
  replies: list[str] = dataclasses.field(default_factory=list)
  policy_replies: list[str] = dataclasses.field(default_factory=list)
  parse_failures: int = 0
  reply_failures: int = 0  # opening/reply answers without a usable reply line (retried ones too)
  silent_replies: int = 0  # user lines replaced by the silent reply: no usable reply after the retries
  termination: str | None = None
  messages: list[Message] = dataclasses.field(default_factory=list)
  sent: int = 0  # how many of `messages` the backend has already been given

  def __post_init__(self):
    if not self.emotions:
      self.emotions.append(self.emotion)

  @property
  def turns(self) -> int:
    """Policy replies received so far."""
    return len(self.policy_replies)

  @property
  def done(self) -> bool:
    return self.termination is not None

  @property
  def state(self) -> str:
    return emotion_state(self.emotion)

  @property
  def reward(self) -> float:
    """Trajectory reward: max(e / 100, 0)."""
    return max(self.emotion / 100.0, 0.0)

  def apply(self, change: int | None) -> int:
    """Records one emotion update (a parse failure, None, means change 0); returns the change."""
    applied = 0 if change is None else change
    self.changes.append(applied)
    self.parsed.append(change is not None)
    self.emotion = apply_change(self.emotion, applied)
    self.emotions.append(self.emotion)
    return applied

  def emotion_termination(self, max_turns: int) -> str | None:
    """The ending forced by the emotion value or the turn budget, if any."""
    if self.emotion >= 100:
      return "emotion_full"
    if self.emotion <= 0:
      return "emotion_zero"
    if self.turns >= max_turns:
      return "max_turns"
    return None


@dataclasses.dataclass(frozen=True)
class TurnResult:
  """The outcome of one policy turn for one dialogue row."""
  row: int
  turn: int  # 1-based index of the policy reply
  change: int  # applied change (0 after a parse failure)
  parsed: bool
  emotion: int  # after the update
  state: str
  reasoning: str  # the last emotion-step analysis
  user_reply: str | None  # None when the dialogue ended by max_turns (no reply is generated)
  done: bool
  termination: str | None
  parse_failures: int  # unparsable analyses during this turn
  reply_failures: int = 0  # answers without a usable reply line during this turn


class SimulatedUsers:
  """A batch of simulated users, one per profile, driven turn by turn against a backend.

  Call `opening()` once, then `step(rows, policy_replies)` with any subset of the live rows. A
  dialogue that ends by emotion (e >= 100 or e <= 0) still gets its final user line (state S or F
  means: say goodbye); one that ends by `max_turns` does not, since nobody would read it.
  """

  def __init__(self, profiles: Sequence[Profile], backend: SimulatorBackend, *,
               style: str = "vanilla", start_emotion: int = 30, max_turns: int = 8,
               max_parse_retries: int = 2, language_override: str | None = None):
    if style not in prompts.STYLES:
      raise ValueError(f"unknown simulator style {style!r}; expected one of {prompts.STYLES}")
    if language_override is not None and language_override not in prompts.LANGUAGES:
      raise ValueError(
          f"unknown language {language_override!r}; expected one of {prompts.LANGUAGES}")
    if max_turns < 1 or max_parse_retries < 0 or not 0 <= start_emotion <= 100:
      raise ValueError("need max_turns >= 1, max_parse_retries >= 0 and 0 <= start_emotion <= 100")
    self.profiles = list(profiles)
    self.backend = backend
    self.style = style
    self.start_emotion = start_emotion
    self.max_turns = max_turns
    self.max_parse_retries = max_parse_retries
    self.records = [
        UserState(row=i, profile=p, language=language_override or p.language, emotion=start_emotion)
        for i, p in enumerate(self.profiles)
    ]
    self._opened = False
    backend.reset(len(self.records))

  def __len__(self) -> int:
    return len(self.records)

  def live_rows(self) -> list[int]:
    """Ids of the dialogues still running, ascending."""
    return [r.row for r in self.records if not r.done]

  @property
  def done(self) -> bool:
    return all(r.done for r in self.records)

  def rewards(self) -> list[float]:
    return [r.reward for r in self.records]

  def opening(self) -> list[str]:
    """The users' first utterances for all rows (preset `first_talk`, else generated)."""
    if self._opened:
      raise RuntimeError("opening() was already called")
    self._opened = True
    to_generate = []
    for rec in self.records:
      rec.messages.append({"role": "system",
                           "content": prompts.system_prompt(rec.profile, self.style, rec.language)})
      rec.messages.append({"role": "user", "content": prompts.opening_instruction(
          rec.language, self._passive(rec))})
      if rec.profile.first_talk:
        # Kept in the context; it reaches the backend together with the first emotion step.
        rec.messages.append({"role": "assistant", "content": rec.profile.first_talk})
        rec.replies.append(rec.profile.first_talk)
      else:
        to_generate.append(rec)
    lines, _ = self._speak(to_generate, "opening")
    for rec in to_generate:
      # A context already full gets the silent line here; its first step ends it (context_full).
      rec.replies.append(lines[rec.row] or self._silent(rec))
    return [rec.replies[0] for rec in self.records]

  def step(self, rows: Sequence[int], policy_replies: Sequence[str]) -> list[TurnResult]:
    """One policy turn for the given dialogue ids: emotion step (with retries), then reply step."""
    recs = self._check_rows(rows, policy_replies)
    for rec, reply in zip(recs, policy_replies):
      rec.policy_replies.append(reply)
      rec.messages.append({"role": "user", "content": prompts.emotion_instruction(
          reply, rec.emotion, rec.language, self.style)})
    changes, failures, analyses = self._emotion_step(recs)
    for rec in recs:
      rec.reasoning.append(analyses[rec.row])
      rec.apply(changes[rec.row])
      # A simulator out of context cannot judge or answer: the dialogue ends where it stands.
      full = self._full(rec.row)
      rec.termination = "context_full" if full else rec.emotion_termination(self.max_turns)
    speaking = [rec for rec in recs if rec.termination not in ("max_turns", "context_full")]
    for rec in speaking:
      rec.messages.append({"role": "user", "content": prompts.reply_instruction(
          rec.emotion, rec.state, rec.language, self._passive(rec))})
    lines, reply_failures = self._speak(speaking, "reply")
    user_replies: dict[int, str] = {}
    for rec in speaking:
      if self._full(rec.row):  # no room for the reply: end without one
        rec.termination = rec.termination or "context_full"
        continue
      reply = lines[rec.row] or self._silent(rec)
      rec.replies.append(reply)
      user_replies[rec.row] = reply
      if rec.termination is None and says_goodbye(reply, rec.language):
        rec.termination = "goodbye"
    return [
        TurnResult(row=rec.row, turn=rec.turns, change=rec.changes[-1], parsed=rec.parsed[-1],
                   emotion=rec.emotion, state=rec.state, reasoning=rec.reasoning[-1],
                   user_reply=user_replies.get(rec.row), done=rec.done,
                   termination=rec.termination, parse_failures=failures[rec.row],
                   reply_failures=reply_failures.get(rec.row, 0))
        for rec in recs
    ]

  def _emotion_step(self, recs: list[UserState]):
    """Runs the analysis, re-asking only the rows whose change line could not be parsed."""
    return self._ask(recs, "emotion", "retry", parse_change, prompts.retry_instruction,
                     "parse_failures")

  def _speak(self, recs: list[UserState], kind: str):
    """Generates user lines, re-asking only the rows whose answer had no usable reply line.

    Returns the lines by row (None: still none after `max_parse_retries` retries, or the context
    is full) and the failures per row. A truncated answer is treated like any other: if it holds a
    reply marker the (possibly cut) line after it is used, else the row is asked again.
    """
    lines, failures, _ = self._ask(recs, kind, "reply_retry", extract_reply,
                                   prompts.reply_retry_instruction, "reply_failures")
    return lines, failures

  def _ask(self, recs: list[UserState], kind: str, retry_kind: str, parse, retry_prompt,
           counter: str):
    """Generates for `recs`, then re-asks (up to `max_parse_retries` times, a `retry_prompt` in the
    row's append-only context) only the rows whose answer `parse` turns into None. A full row is
    not retried. Returns (parsed by row, failures by row this call, last text by row); each failure
    also adds 1 to the row's `counter` attribute."""
    parsed: dict[int, object] = {}
    failures = {rec.row: 0 for rec in recs}
    texts: dict[int, str] = {}
    pending = recs
    for attempt in range(self.max_parse_retries + 1):
      failed = []
      for rec, text in zip(pending, self._generate(pending, kind)):
        texts[rec.row] = text
        parsed[rec.row] = parse(text)
        if parsed[rec.row] is None and not self._full(rec.row):  # full: nothing to retry
          failures[rec.row] += 1
          setattr(rec, counter, getattr(rec, counter) + 1)
          failed.append(rec)
      if not failed or attempt == self.max_parse_retries:
        break
      for rec in failed:
        rec.messages.append({"role": "user", "content": retry_prompt(rec.language)})
      pending, kind = failed, retry_kind
    return parsed, failures, texts

  def _silent(self, rec: UserState) -> str:
    """The line shown in place of a reply that never came (counted unless the context is full)."""
    if not self._full(rec.row):
      rec.silent_replies += 1
    return _SILENT_REPLY.get(rec.language, _SILENT_REPLY["en"])

  def _full(self, row: int) -> bool:
    is_full = getattr(self.backend, "is_full", None)  # optional for backends without a context bound
    return bool(is_full(row)) if is_full is not None else False

  def _generate(self, recs: list[UserState], kind: str) -> list[str]:
    """Sends each row its unsent messages, records the answers in the rows' contexts."""
    if not recs:
      return []
    requests = [
        SimRequest(row=rec.row, new_messages=tuple(rec.messages[rec.sent:]), kind=kind,
                   profile=rec.profile, language=rec.language,
                   policy_reply=rec.policy_replies[-1] if rec.policy_replies else None,
                   emotion=rec.emotion, state=rec.state)
        for rec in recs
    ]
    texts = self.backend.generate(requests)
    if len(texts) != len(requests):
      raise RuntimeError(f"backend returned {len(texts)} texts for {len(requests)} requests")
    out = []
    for rec, text in zip(recs, texts):
      text = text if isinstance(text, str) else str(text)
      rec.messages.append({"role": "assistant", "content": text})
      rec.sent = len(rec.messages)
      out.append(text)
    return out

  def _check_rows(self, rows: Sequence[int], policy_replies: Sequence[str]) -> list[UserState]:
    if not self._opened:
      raise RuntimeError("call opening() before step()")
    try:  # numpy integers are fine; floats and strings are not
      rows = [operator.index(r) for r in rows]
    except TypeError:
      raise TypeError(f"rows must be integer dialogue ids, got {list(rows)!r}") from None
    policy_replies = list(policy_replies)
    if len(rows) != len(policy_replies):
      raise ValueError(f"{len(rows)} rows but {len(policy_replies)} policy replies")
    if len(set(rows)) != len(rows):
      raise ValueError(f"duplicate rows in {rows}")
    for row in rows:
      if not 0 <= row < len(self.records):
        raise IndexError(f"row {row!r} is not a dialogue id in [0, {len(self.records)})")
      if self.records[row].done:
        raise ValueError(f"dialogue {row} already ended ({self.records[row].termination})")
    return [self.records[row] for row in rows]

  @staticmethod
  def _passive(rec: UserState) -> bool:
    try:
      return personality_key(rec.profile) == "passive"
    except ValueError:  # a custom personality type: no special rule
      return False
