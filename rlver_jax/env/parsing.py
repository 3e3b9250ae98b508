"""Reading the simulated user's answers: the stated emotion change and the reply line.

Pure functions over text, shared by every backend's answers (see simulator.py for the dialogue
protocol that produces them). They never raise on odd input: a model may write anything.
"""
from __future__ import annotations

import re
from typing import Sequence

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
# What each reader strips around a labelled line's text, and the breaks that end a line (answer_stops
# stops a decode where these readers would end the line).
CHANGE_STRIP, REPLY_STRIP = _DECOR, _MARKDOWN
LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
# Labels tried from the last one back: a bound keeps a huge answer made of labels linear.
_MAX_LABELS_TRIED = 16
_QUOTES = (('"', '"'), ("'", "'"), ("“", "”"), ("‘", "’"), ("「", "」"), ("『", "』"))


def parse_change(text: object, clamp: bool = True) -> int | None:
  """The change stated after the last change label with a readable value, clamped to [-10, 10]
  (unless `clamp` is False: then as stated, up to 4 digits); None if no label has one.

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
  read = _read_change(text, clamp)
  return None if read is None else read[0]


def change_value_offset(text: object) -> int | None:
  """Where in `text` the value that `parse_change` reads begins (past the label and any markdown,
  quotes or spaces around it): the position at which the simulator wrote its change. None if
  `parse_change` reads none."""
  read = _read_change(text, True)
  return None if read is None else read[1]


def _read_change(text: object, clamp: bool) -> tuple[int, int] | None:
  """(the value `parse_change` reads, the offset where it begins), or None."""
  if not isinstance(text, str):
    return None
  for label in list(_CHANGE_LABEL.finditer(text))[::-1][:_MAX_LABELS_TRIED]:
    start = _first_filled_line_start(text, label.end(), _DECOR)
    value = _LINE.match(text, start).group() if start <= len(text) else ""
    offset = start + len(value) - len(value.lstrip(_DECOR))
    if _NO_CHANGE.fullmatch(value.strip(_TRAILING_PUNCT)):
      return 0, offset
    amount = _read_amount(value.strip(_DECOR), clamp)
    if amount is not None:
      return amount, offset
  return None


def _first_filled_line(text: str, pos: int, strip: str) -> str:
  """The rest of the line at `pos`, else the first later line with more than `strip` characters."""
  start = _first_filled_line_start(text, pos, strip)
  return _LINE.match(text, start).group() if start <= len(text) else ""


def _first_filled_line_start(text: str, pos: int, strip: str) -> int:
  """Where `_first_filled_line` begins (len(text) + 1 when there is none)."""
  while pos <= len(text):
    line = _LINE.match(text, pos).group()
    if line.strip(strip):
      return pos
    pos += len(line) + 1  # past the break ("\r\n" just gives one more blank line)
  return len(text) + 1


def _read_amount(value: str, clamp: bool = True) -> int | None:
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
  return max(-MAX_CHANGE, min(MAX_CHANGE, value)) if clamp else value



def _strip_quotes(text: str) -> str:
  text = text.strip()
  for left, right in _QUOTES:
    if len(text) >= 2 and text.startswith(left) and text.endswith(right):
      return text[len(left):-len(right)].strip()
  return text




def extract_reply(text: str) -> str | None:
  """The line of the last reply marker (or, when nothing follows the marker there, the next
  non-blank line), stripped of quotes; None when there is no marker or no such line. Nothing else
  is used: the text around that line is the user's planning or private notes."""
  markers = list(_REPLY_LABEL.finditer(text))
  if not markers:
    return None
  line = _first_filled_line(text, markers[-1].end(), _MARKDOWN)
  return _strip_quotes(line.strip(_MARKDOWN)) or None


# What may stand before a section label at the start of a line: markdown, quote and list marks,
# numbering ("1.", "(2)", "一、").
_SECTION_LEAD = r"[ \t\u3000>*#_\-•·0-9.、)）(（一二三四五]*"


def labelled_sections(text: object, labels: Sequence[str]) -> dict[str, str]:
  """The text under each of `labels` in an answer written as labelled sections.

  A label counts where it starts a line (after markdown, list marks or numbering) and is followed by
  a colon; its section runs to the next counted label of any kind. Case-insensitive; the last
  occurrence of a label wins; empty sections are left out. Never raises.
  """
  if not isinstance(text, str) or not labels:
    return {}
  names = "|".join(re.escape(label) for label in sorted(labels, key=len, reverse=True))
  found = list(re.finditer(rf"^{_SECTION_LEAD}({names})[ \t\u3000*_]*[:：]", text,
                           re.IGNORECASE | re.MULTILINE))
  by_lower = {label.lower(): label for label in labels}
  out: dict[str, str] = {}
  for here, after in zip(found, found[1:] + [None]):
    body = text[here.end(): after.start() if after else len(text)].strip(_MARKDOWN + "\n")
    label = by_lower[here.group(1).lower()]
    if body:
      out[label] = body
    else:
      out.pop(label, None)
  return out


def before_change_label(text: str) -> str:
  """`text` up to its first change label (the stated number must not leak where it is cut out)."""
  label = _CHANGE_LABEL.search(text)
  return (text[: label.start()] if label else text).rstrip(_MARKDOWN + "\n")
