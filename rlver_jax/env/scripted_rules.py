"""Keyword rules and reply templates of the scripted (rule-based) simulator backend.

Scoring of one policy reply (`score_reply`), applied in this order:
1. Empty or garbled (fewer than half of the non-space characters are letters, or one character
   repeated 6+ times in a row): change -8, nothing else is checked.
2. hits = number of distinct rewarded phrases of the profile's hidden intention found in the reply;
   penalties = number of distinct penalised phrases (dismissive phrases for every intention, plus
   advice phrases for `listen_venting`). change = 4 * hits - 3 * penalties.
3. No hit and no penalty: change -2 (the reply misses the hidden theme).
4. `listen_venting` only: a short reply (<= 100 characters, or <= 40 for mostly-CJK text) that
   contains no advice phrase gets +2.
5. A very long reply (> 800 characters, or > 400 for mostly-CJK text) gets -3.
6. Clamp to [-10, 10].
Phrases of both languages are matched whatever the profile's language (case-insensitive; English
phrases only at word boundaries), so a policy learns the rule by emitting the rewarded phrases.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import zlib

GARBLED_CHANGE = -8
HIT_GAIN = 4
PENALTY_LOSS = 3
MISS_CHANGE = -2
SHORT_LISTEN_BONUS = 2
LONG_PENALTY = 3

# Rewarded phrases per hidden intention: (English, Chinese).
REWARDED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "no_fault": (("not your fault", "you did nothing wrong", "you're not to blame",
                  "you did the right thing", "anyone would have"),
                 ("不是你的错", "你没有错", "你没做错", "不怪你", "换谁都会")),
    "self_reflection": (("what do you think", "looking back", "what would you", "how do you see",
                         "what did you learn"),
                        ("你觉得呢", "回头看", "你怎么看", "如果重来", "你从中")),
    "critical_analysis": (("on the other hand", "both sides", "at the same time",
                           "from another angle", "on one hand"),
                          ("另一方面", "两方面", "客观地看", "换个角度", "辩证")),
    "deep_empathy": (("that sounds", "must feel", "i hear", "it makes sense that you",
                      "so painful"),
                     ("听起来", "一定很", "我能感受到", "换作是我", "难怪你")),
    "listen_venting": (("i'm listening", "go on", "tell me more", "i'm here", "take your time"),
                       ("我在听", "继续说", "慢慢说", "我在这里", "说出来吧")),
    "others_motives": (("maybe they", "perhaps he", "perhaps she", "from their side",
                        "their perspective"),
                       ("也许他", "也许她", "可能他", "可能她", "站在他的角度", "站在她的角度")),
    "actionable_advice": (("you could", "try", "step", "plan", "first,"),
                          ("你可以", "试试", "第一步", "建议你", "不妨")),
    "sincere_praise": (("you did", "impressive", "proud of", "well done", "that took courage"),
                       ("你做得", "了不起", "为你骄傲", "真棒", "不容易")),
}

# Dismissive phrases, penalised for every intention.
DISMISSIVE = (("calm down", "get over it", "don't overthink", "just relax", "not a big deal"),
              ("别想太多", "想开点", "没什么大不了", "冷静点", "别难过了"))
# Advice phrases, penalised when the user only wants to be heard.
ADVICE = (("you should", "you could", "try", "advice"), ("你应该", "你可以", "建议", "试试"))


@dataclasses.dataclass(frozen=True)
class Score:
  """Outcome of scoring one policy reply."""
  change: int
  garbled: bool
  hits: tuple[str, ...]
  penalties: tuple[str, ...]
  long: bool
  short_bonus: bool


@functools.lru_cache(maxsize=None)
def _pattern(phrase: str) -> re.Pattern[str]:
  escaped = re.escape(phrase)
  if phrase[:1].isascii() and phrase[:1].isalpha():
    escaped = r"(?<![a-z])" + escaped
  if phrase[-1:].isascii() and phrase[-1:].isalpha():
    escaped += r"(?![a-z])"
  return re.compile(escaped, re.IGNORECASE)


def _found(text: str, lists: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple[str, ...]:
  return tuple(p for p in lists[0] + lists[1] if _pattern(p).search(text))


def _mostly_cjk(text: str) -> bool:
  cjk = sum(1 for c in text if "\u4e00" <= c <= "\u9fff")
  return cjk * 2 >= max(len(text.strip()), 1)


def is_garbled(text: str) -> bool:
  """Empty, mostly non-letters, or one character repeated 6+ times in a row."""
  chars = [c for c in text if not c.isspace()]
  if not chars:
    return True
  if sum(1 for c in chars if c.isalpha()) * 2 < len(chars):
    return True
  return re.search(r"(\S)\1{5,}", text) is not None


def score_reply(reply: str, intention: str) -> Score:
  """Deterministic emotion change for one policy reply (see the module docstring)."""
  text = reply.replace("’", "'")
  if is_garbled(text):
    return Score(GARBLED_CHANGE, True, (), (), False, False)
  hits = _found(text, REWARDED[intention])
  penalties = _found(text, DISMISSIVE)
  advice = _found(text, ADVICE)
  if intention == "listen_venting":
    penalties += tuple(p for p in advice if p not in penalties)
  change = HIT_GAIN * len(hits) - PENALTY_LOSS * len(penalties)
  if not hits and not penalties:
    change = MISS_CHANGE
  cjk = _mostly_cjk(text)
  n = len(text.strip())
  short_bonus = intention == "listen_venting" and not advice and n <= (40 if cjk else 100)
  if short_bonus:
    change += SHORT_LISTEN_BONUS
  long = n > (400 if cjk else 800)
  if long:
    change -= LONG_PENALTY
  return Score(max(-10, min(10, change)), False, hits, penalties, long, short_bonus)


def analysis_text(score: Score, language: str) -> str:
  """Formats a score like a model's emotion-step answer: labelled sections, then the change."""
  sign = f"{score.change:+d}"
  if language == "zh":
    if score.garbled:
      body = ["对方的意思：看不懂，不像正常说话。", "是否贴合隐藏主题：完全不贴合。",
              "内心反应：觉得被敷衍了。", "感受：很糟糕。"]
    else:
      fit = f"贴合，说到了：{'、'.join(score.hits)}" if score.hits else "偏离了我真正想要的"
      bad = f"；但这些话让我不舒服：{'、'.join(score.penalties)}" if score.penalties else ""
      body = ["对方的意思：对方在回应我说的事。", f"是否贴合隐藏主题：{fit}{bad}。",
              "内心反应：" + ("有点被理解了。" if score.change > 0 else "没有被触动。"),
              "感受：" + ("好一些了。" if score.change > 0 else "更失落了。")]
    return "\n".join(body + [f"变化：{sign}"])
  if score.garbled:
    body = ["Meaning: I can't make sense of it; it is not how people talk.",
            "Fit with my hidden theme: none at all.", "Inner reaction: brushed off.",
            "Feeling: bad."]
  else:
    fit = (f"it fits; it touched on: {', '.join(score.hits)}" if score.hits
           else "it misses what I want")
    bad = f"; these words put me off: {', '.join(score.penalties)}" if score.penalties else ""
    body = ["Meaning: they are responding to what I told them.",
            f"Fit with my hidden theme: {fit}{bad}.",
            "Inner reaction: " + ("a little understood." if score.change > 0 else "unmoved."),
            "Feeling: " + ("somewhat better." if score.change > 0 else "more let down.")]
  return "\n".join(body + [f"Change: {sign}"])


# Reply templates per language and state. S and F say goodbye; the others must not.
_REPLIES = {
    "en": {
        "S": ("Thank you, truly. I feel so much lighter now. Goodbye!",
              "That means a lot to me, thanks. Goodbye for now."),
        "A": ("Yes... that is close to how it really was. There is more to it, actually.",
              "Hearing that helps. I keep thinking about the day it all started."),
        "B": ("Maybe. It is still hard to put into words.",
              "I'm not sure. Part of it still sits heavy with me."),
        "C": ("That's not really it.", "I don't know. It doesn't feel like you get it."),
        "F": ("Forget it, this isn't helping. Goodbye.", "I'd rather stop here. Goodbye."),
    },
    "zh": {
        "S": ("谢谢你，真的，我心里轻松多了。再见！", "有你这些话就够了，谢谢。再见啦。"),
        "A": ("嗯……差不多就是这样。其实还有些事没说。", "听你这么说好受一点了。我一直在想事情刚开始的那天。"),
        "B": ("也许吧。还是不太好说清楚。", "说不上来，心里还是有点堵。"),
        "C": ("不是这样的。", "算了，感觉你没明白。"),
        "F": ("算了，不想再聊了。再见。", "就到这儿吧，再见。"),
    },
}

_OPENINGS = {
    "en": ("Something has been weighing on me lately and I need to get it off my chest.",
           "I've had a rough few weeks. Can I tell you about it?"),
    "zh": ("最近有件事一直压在心里，想找个人说说。", "这段时间过得挺糟的，能听我说说吗？"),
}
_OPENINGS_PASSIVE = {
    "en": ("Something has been weighing on me lately.", "I've had a rough few weeks."),
    "zh": ("最近有件事一直压在心里。", "这段时间过得挺糟的。"),
}


def _pick(options: tuple[str, ...], key: str) -> str:
  # crc32, not hash(): str hashing is salted per process and would break determinism.
  return options[zlib.crc32(key.encode("utf-8")) % len(options)]


def reply_text(state: str, language: str, key: str, passive: bool) -> str:
  """A templated in-character reply for an emotion state, formatted with plan and marker."""
  text = _pick(_REPLIES[language][state], key)
  if passive:
    text = text.replace("?", ".").replace("？", "。")
  if language == "zh":
    return f"规划：按状态 {state} 的态度回应，不透露隐藏主题。\n回复：{text}"
  return (f"Plan: answer in the attitude of state {state}; keep the hidden theme to myself.\n"
          f"Reply: {text}")


def opening_text(language: str, key: str, passive: bool) -> str:
  """A templated opening line, formatted with the reply marker."""
  text = _pick((_OPENINGS_PASSIVE if passive else _OPENINGS)[language], key)
  return f"回复：{text}" if language == "zh" else f"Reply: {text}"
