"""Policy side of a dialogue: system prompts, parsing of policy output, goodbye detection."""
from __future__ import annotations

import dataclasses
import re

from rlver_jax.env.policy_prompts import (SYSTEM_PROMPTS, TRAINING_PROMPTS,  # noqa: F401
                                          policy_system_prompt)

# --- Parsing policy output ----------------------------------------------------------------------

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
STOP_MARKERS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")

# Speaker names a chat model tends to put in front of its reply; matched only at the very start.
_SPEAKER_LABEL = re.compile(
    r"^\s*(?:\*\*)?(?:assistant|ai|me|bot|npc|reply|response|助手|AI助手|我|回复|回答)"
    r"(?:\*\*)?\s*[:：]\s*(?:\*\*)?",
    re.IGNORECASE)


# What of a reply reaches the user: "label" drops one leading speaker label (_SPEAKER_LABEL);
# "reference" is the RLVER reference's cut: in think mode the text after the last 你： / 你:, in
# no-think mode the text as it is.
REPLY_CUTS = ("label", "reference")
_REFERENCE_LABELS = ("你：", "你:")


@dataclasses.dataclass(frozen=True)
class PolicyTurn:
  """One parsed policy turn: optional thought, the visible reply, and whether the format held."""
  thought: str | None
  reply: str
  format_ok: bool


def strip_stop(text: str) -> str:
  """Cuts the text at the first stop marker; anything decoded past one is not part of the turn."""
  cut = min((i for i in (text.find(m) for m in STOP_MARKERS) if i >= 0), default=len(text))
  return text[:cut]


def strip_speaker_label(text: str) -> str:
  """Removes one leading "Assistant:"-style label (ASCII or full-width colon)."""
  return _SPEAKER_LABEL.sub("", text, count=1).strip()


def _last_thought(text: str) -> str | None:
  close = text.rfind(THINK_CLOSE)
  if close < 0:
    return None
  open_ = text.rfind(THINK_OPEN, 0, close)
  if open_ < 0:
    return None
  return text[open_ + len(THINK_OPEN):close].strip()


def cut_reply(visible: str, think: bool, cut: str = "label") -> str:
  """The part of the visible text (after the last </think>) that the user sees (REPLY_CUTS)."""
  if cut == "label":
    return strip_speaker_label(visible.strip())
  if cut != "reference":
    raise ValueError(f"unknown reply cut {cut!r}; expected one of {REPLY_CUTS}")
  if think:
    start = max((visible.rfind(m) + len(m) for m in _REFERENCE_LABELS if m in visible), default=0)
    visible = visible[start:]
  return visible.strip()


def parse_policy_output(text: str, think: bool, reply_cut: str = "label") -> PolicyTurn:
  """Splits raw policy text into thought and visible reply, and checks the expected format."""
  text = strip_stop(text)
  close = text.rfind(THINK_CLOSE)
  visible = text[close + len(THINK_CLOSE):] if close >= 0 else text
  reply = cut_reply(visible, think, reply_cut)
  thought = _last_thought(text)
  n_open, n_close = text.count(THINK_OPEN), text.count(THINK_CLOSE)
  if think:
    format_ok = (text.lstrip().startswith(THINK_OPEN) and n_open == 1 and n_close == 1
                 and bool(thought) and bool(reply))
  else:
    format_ok = n_open == 0 and n_close == 0 and bool(reply)
  return PolicyTurn(thought=thought, reply=reply, format_ok=format_ok)


# --- Goodbye detection --------------------------------------------------------------------------

# 再见 is also "see again" (不想再见他, 再见到, 还能再见吗), so 再见/拜拜 only count at a clause end: after
# optional particles (了, 啦, 吧, ~, ...) and an optional address (朋友们, 大家, 您嘞, ...) comes the end
# of the text or a mark that is no word character and no question mark (punctuation, space, emoji).
_ZH_GOODBYE = re.compile(
    r"(?:再见|拜拜)(?:[了啦咯喽哦噢喔呀啊吧哈嘛~～])*(?:朋友们?|大家|各位|宝贝|亲爱的|您嘞|您|你|啦)?(?![\w?？])")
# Negated, wished-for or reported: 不想再见了, 还能再见, 没来得及跟她说再见.
_ZH_NOT_SAYING = re.compile(
    r"(?:不想|不愿意?|不要|不会|不能|不用|不必|没有?|没能|没来得及|别|舍不得|还能|还会|能不能|会不会|希望|期待)"
    r"(?:再也)?(?:[和跟与对同][你他她]们?)?[说道]?$")

# Farewell words and phrases as whole words; ASCII-letter guards instead of \b so that "bye"
# glued to Chinese text ("好的bye") still counts while "byes" / "bystander" do not.
_EN_FAREWELL = re.compile(
    r"(?<![A-Za-z])(?:good[\s-]?bye|bye(?:[\s-]?bye)?|byebye|farewell|see\s+(?:you|ya)|"
    r"catch\s+you\s+later|talk\s+(?:to\s+you\s+)?(?:later|soon)|take\s+care)(?![A-Za-z])",
    re.IGNORECASE)
# Describing a farewell ("I said goodbye to him", "a farewell party") is not saying one.
_REPORTED_BEFORE = re.compile(
    r"\b(?:said|says|saying|wave|waved|waving|kiss|kissed|a|the|my|his|her|their|our)"
    r"\s+$", re.IGNORECASE)
_NOT_FAREWELL_AFTER = re.compile(
    r"^(?:\s+(?:to|party|parties|gift|card|letter|hug|kiss|message|note|speech|dinner|lunch|"
    r"drinks|tour|week)\b|['’]\w)", re.IGNORECASE)
# "see you" / "take care" / "talk later" are also ordinary phrases ("I see you care", "take care
# of it", "talk later with my boss"), so they only count before punctuation, an emoji, the end of
# the text or a time word.
_CLAUSE_END_AFTER = re.compile(
    r"^(?:\s*(?:[^\w\s]|$)|\s+(?:later|soon|tomorrow|around|again|then|next|another|"
    r"sometime|in\s+a\s+(?:bit|while)|on\s+\w+day)\b)", re.IGNORECASE)
_NEEDS_CLAUSE_END = re.compile(r"^(?:see|take|talk)\b", re.IGNORECASE)
# ... nor when negated or wished for: "I never want to see you again", "nice to see you", "won't
# see you", "will I ever see you again?".
_UNWILLING_BEFORE = re.compile(
    r"(?:\b(?:i|never|not|no|ever|wanna)|\b(?:nice|good|great|glad|happy|want|wanted|like|love|hope|"
    r"wish|longing)\s+to|n['’]t)\s+$", re.IGNORECASE)


def _is_english_farewell(text: str) -> bool:
  for m in _EN_FAREWELL.finditer(text):
    before, after = text[:m.start()], text[m.end():]
    if _REPORTED_BEFORE.search(before) or _NOT_FAREWELL_AFTER.match(after):
      continue
    if _NEEDS_CLAUSE_END.match(m.group(0)):
      if _UNWILLING_BEFORE.search(before) or not _CLAUSE_END_AFTER.match(after):
        continue
    return True
  return False


def _is_chinese_farewell(text: str) -> bool:
  return any(not _ZH_NOT_SAYING.search(text[:m.start()]) for m in _ZH_GOODBYE.finditer(text))


GOODBYE_MATCHES = ("clause", "substring")
# The reference and SAGE look for 再见 / 拜拜 anywhere in the line; "bye" stands in for English users.
_GOODBYE_SUBSTRINGS = ("再见", "拜拜", "bye")


def says_goodbye(text: str, language: str, match: str = "clause") -> bool:
  """True when the simulated user's utterance takes leave of the conversation.

  "clause": Chinese text matches 再见/拜拜 ending a clause and not negated (and English farewells,
  which Chinese users also type); English text matches whole-word farewells, skipping ones that are
  merely described, negated or wished for. "substring": any 再见, 拜拜 or "bye" anywhere (so "不想再见
  到他" ends the dialogue too), as the reference matches.
  """
  if match not in GOODBYE_MATCHES:
    raise ValueError(f"unknown goodbye match {match!r}; expected one of {GOODBYE_MATCHES}")
  if language not in ("zh", "en"):
    raise ValueError(f"unsupported language {language!r}; expected 'en' or 'zh'")
  if match == "substring":
    return any(word in text.lower() for word in _GOODBYE_SUBSTRINGS)
  if language == "zh":
    return _is_chinese_farewell(text) or _is_english_farewell(text)
  if language == "en":
    return _is_english_farewell(text)
  raise ValueError(f"unsupported language {language!r}; expected 'en' or 'zh'")
