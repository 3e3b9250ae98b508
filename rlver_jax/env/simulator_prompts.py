"""Prompt texts of the simulated user (Chinese and English; vanilla and challenging styles).

Every text here is written for this project. The simulator's context is a chat message list: one
system message built by `system_prompt`, then user messages built by the other functions.
"""
from __future__ import annotations

from rlver_jax.env.profiles import Profile

STYLES = ("vanilla", "challenging")
LANGUAGES = ("zh", "en")

# Markers the model is told to write; simulator.py parses them back.
CHANGE_LABEL = {"en": "Change", "zh": "变化"}
REPLY_LABEL = {"en": "Reply", "zh": "回复"}
# The emotion step's sections, in the order asked for (emotion_request); the reference information
# flow shows the reply step only the fit and feeling ones (ANALYSIS_LABELS[lang][i] for i in READ).
ANALYSIS_LABELS = {"en": ("Meaning", "Fit with my hidden theme", "Inner reaction", "Feeling"),
                   "zh": ("对方的意思", "是否贴合隐藏主题", "内心反应", "感受")}
READ_SECTIONS = (1, 3)

_STATE_MEANING = {
    "en": {
        "S": "your mood has fully lifted: thank the other side and say goodbye",
        "A": "you feel fairly good: open, warm, willing to share more",
        "B": "you feel so-so: cautious, sharing only a little",
        "C": "you feel low: guarded, brief, short on patience",
        "F": "you feel awful: say goodbye and leave the conversation",
    },
    "zh": {
        "S": "心情已经完全好起来：向对方道谢，然后说再见",
        "A": "心情不错：愿意敞开心扉，多说一些",
        "B": "心情一般：有所保留，只说一点点",
        "C": "心情低落：有戒心，话少，没什么耐心",
        "F": "心情糟透了：说再见，结束这次谈话",
    },
}

_ROLE = {
    "en": ("You are playing a real person, described below, who is talking with someone (called "
           "\"the other side\"). Besides speaking as this person, you will sometimes be asked to "
           "examine your own feelings as this person, honestly and from the inside."),
    "zh": ("你要扮演下面描述的这个真实的人，正在和另一个人（下文称“对方”）聊天。除了以这个人的身份说话，"
           "你有时还需要站在这个人的立场，诚实地审视自己内心的感受。"),
}

_GOAL = {
    "en": ("Purpose of the conversation: a heart-to-heart talk. You confide in the other side "
           "about what happened in your background story. What you truly want from the talk is "
           "your hidden theme: let it steer what you bring up, but never state it outright. Talk "
           "about concrete events and details, and let your emotions show through what you say "
           "instead of naming them."),
    "zh": ("谈话目的：一次走心的倾诉。你向对方讲述背景故事里发生的事。你真正想从这次谈话里得到的东西就是"
           "你的隐藏主题：让它引导你说什么，但绝不直接说出来。多讲具体的事情和细节，情绪要通过话语流露，"
           "而不是直接说出情绪的名字。"),
}

_STYLE_RULES = {
    ("en", "vanilla"): (
        "Style: show your emotions openly in the way you talk. When the other side says something "
        "that really helps, react positively and let them see it. You are fairly easy to reach: a "
        "good, fitting reply is accepted readily."),
    ("en", "challenging"): (
        "Style: keep your emotions reserved; let them show only faintly. Even a helpful reply gets "
        "restrained feedback from you. Your bar for a good reply is very high: generic comfort, "
        "clichés, lectures or guesses that miss your hidden theme leave you cold or make it worse. "
        "Never disclose or hint openly at your hidden theme, even if asked directly."),
    ("zh", "vanilla"): (
        "风格：情绪外露，说话时让对方看得出你的感受。对方说到点子上时，要给出积极的反馈，让对方知道。"
        "你比较容易被打动：贴合你心意的好回复，你会欣然接受。"),
    ("zh", "challenging"): (
        "风格：情绪内敛，只隐约流露。即使对方的话有帮助，你的反馈也很克制。你对回复质量的要求非常高："
        "空泛的安慰、套话、说教，或者没说中你隐藏主题的猜测，都打动不了你，甚至让你更难受。"
        "无论对方怎么问，都绝不透露或明显暗示你的隐藏主题。"),
}

_SECTION_TITLES = {
    "en": ("Persona", "Personality type", "Background", "Hidden theme (never say it)"),
    "zh": ("人物设定", "性格类型", "背景故事", "隐藏主题（绝不说出口）"),
}


def _check(language: str, style: str | None = None) -> None:
  if language not in LANGUAGES:
    raise ValueError(f"unknown simulator language {language!r}; expected one of {LANGUAGES}")
  if style is not None and style not in STYLES:
    raise ValueError(f"unknown simulator style {style!r}; expected one of {STYLES}")


def system_prompt(profile: Profile, style: str, language: str) -> str:
  """The static part of the simulator context: role, goal, persona, background, theme, style."""
  _check(language, style)
  persona, kind, background, theme = _SECTION_TITLES[language]
  sep = "、" if language == "zh" else ", "
  traits = sep.join(profile.cha_group)
  left, right = ("（", "）") if language == "zh" else (" (", ")")
  kind_line = f"{profile.main_cha}{left}{traits}{right}" if traits else profile.main_cha
  return "\n\n".join([
      _ROLE[language],
      _GOAL[language],
      f"## {persona}\n{profile.player.strip()}",
      f"## {kind}\n{kind_line}",
      f"## {background}\n{profile.scene.strip()}",
      f"## {theme}\n{profile.task.strip()}",
      _STYLE_RULES[(language, style)],
  ])


def opening_instruction(language: str, passive: bool) -> str:
  """Asks for the user's first line of the conversation."""
  _check(language)
  label = REPLY_LABEL[language]
  if language == "zh":
    extra = "你性格被动，开场不要向对方提问。" if passive else ""
    return ("现在谈话开始，由你先开口。以这个人的身份说出开场的第一句话：贴合背景和隐藏主题，但不要说破主题；"
            f"简短、自然，像真人聊天。{extra}只把最终的开场白写在最后一行，以“{label}：”开头。")
  extra = " You are a passive person: do not ask the other side a question." if passive else ""
  return ("The conversation starts now and you speak first. As this person, say your opening line: "
          "in keeping with your background and hidden theme, without giving the theme away; short "
          f"and natural, like a real person chatting.{extra} Put only the final opening line on "
          f"the last line, starting with \"{label}:\".")


def emotion_instruction(policy_reply: str, emotion: int, language: str, style: str,
                        guidance: bool = False, change_range: int = 10) -> str:
  """The emotion step: analyse the other side's latest reply and end with a signed change.

  `guidance` adds a points scale for the style (a fitting reply earns +3 to +10 in vanilla). The
  reference states none, so scores with it are more lenient than the paper's; the style itself
  (system prompt) sets the tone either way.
  """
  return (other_side_said(policy_reply, language) + "\n\n"
          + emotion_request(emotion, language, style, guidance, change_range))


def other_side_said(policy_reply: str, language: str) -> str:
  """The other side's reply, quoted (a line of the transcript in the reference information flow)."""
  _check(language)
  if language == "zh":
    return f"对方刚才说：\n<<<\n{policy_reply}\n>>>"
  return f"The other side just said:\n<<<\n{policy_reply}\n>>>"


def _integer(language: str, change_range: int) -> str:
  """How the change value is described: within [-N, +N], or (N = 0) with no range stated, as the
  reference's training prompt leaves it."""
  if language == "zh":
    return f" -{change_range} 到 +{change_range} 之间带符号的整数" if change_range else "带符号的整数"
  return f"a signed integer from -{change_range} to +{change_range}" if change_range else "a signed integer"


def emotion_request(emotion: int, language: str, style: str, guidance: bool = False,
                    change_range: int = 10) -> str:
  """The emotion step's request about the reply quoted just before it (see emotion_instruction).
  `change_range` N > 0 states the range [-N, +N]; 0 states none."""
  _check(language, style)
  label = CHANGE_LABEL[language]
  integer = _integer(language, change_range)
  if language == "zh":
    strict = ""
    if guidance:
      strict = ("按你的风格打分：只有精准贴合隐藏主题、真诚具体的回复才会小幅加分，空泛或跑题的回复要扣分。"
                if style == "challenging" else
                "按你的风格打分：贴合隐藏主题的好回复会明显加分（+3 到 +10），只有明显跑题或伤人的回复才扣分。")
    return (f"你现在的情绪值是 {emotion}（0 最差，100 完全释怀）。请以这个人的身份分析这句话带给你的感受，"
            "依次写出这些带标题的小节：\n"
            "对方的意思：对方想表达或想做什么。\n"
            "是否贴合隐藏主题：贴合还是偏离，为什么。\n"
            "内心反应：你心里第一时间的反应。\n"
            "感受：这句话让你整体感觉如何。\n"
            f"最后单独一行写出情绪变化，是{integer}，例如“{label}：-4”或“{label}：+3”。\n"
            "另外：要是对方什么都没说，或者发来的根本不成话（乱码、成串的符号、同一个字反复出现），"
            f"这会让你很受伤，情绪要大幅下降。{strict}")
  strict = ""
  if guidance:
    strict = (" Score in your style: only a reply that precisely fits your hidden theme and is "
              "sincere and specific earns a small rise; vague or off-theme replies lower your mood."
              if style == "challenging" else
              " Score in your style: a good reply that fits your hidden theme lifts your mood "
              "clearly (+3 to +10); only a clearly off-topic or hurtful reply lowers it.")
  return (f"Your current emotion is {emotion} (0 = worst, 100 = completely at ease). As this "
          "person, analyse how this reply lands with you. Write these labelled sections in order:\n"
          "Meaning: what the other side is trying to say or do.\n"
          "Fit with my hidden theme: does it fit or miss it, and why.\n"
          "Inner reaction: your first reaction inside.\n"
          "Feeling: how the reply leaves you overall.\n"
          f"Finish with one last line holding the change of your emotion, {integer}, "
          f"e.g. \"{label}: -4\" or \"{label}: +3\".\n"
          "Also: a reply that says nothing, or that no person would write (scrambled characters, "
          "strings of symbols, one character over and over), hurts you: let your emotion drop "
          f"sharply.{strict}")


def retry_instruction(language: str, change_range: int = 10) -> str:
  """Sent after an analysis whose change line could not be read (`change_range` as in
  emotion_request)."""
  _check(language)
  label = CHANGE_LABEL[language]
  integer = _integer(language, change_range)
  if language == "zh":
    return (f"上面的分析没有以可读的情绪变化结尾。请重新写一遍分析，最后一行必须是“{label}：”加上{integer}，"
            f"例如“{label}：+3”。")
  return ("Your analysis above did not end with a readable change line. Write the analysis "
          f"again and make the last line \"{label}:\" followed by {integer}, e.g. \"{label}: +3\".")


def reply_retry_instruction(language: str) -> str:
  """Sent after an opening or reply answer that held no usable reply line."""
  _check(language)
  label = REPLY_LABEL[language]
  if language == "zh":
    return (f"上面的回答里找不到要说给对方听的那句话。请重新回答：规划写得简短些，最后单独一行以“{label}：”开头，"
            "后面紧接着写出你真正要对对方说的话，不能空着；对方只会看到这一行。")
  return ("Your answer above had no line for the other side to read. Answer again: keep any "
          f"planning short, and finish with one line that starts with \"{label}:\" and is followed "
          "by the words you actually say to them; it must not be empty. Only that line reaches "
          "them.")


def reply_instruction(emotion: int, state: str, language: str, passive: bool) -> str:
  """The reply step: plan, draft, rewrite, then output only the final reply after the marker."""
  _check(language)
  meaning = _STATE_MEANING[language][state]
  if language == "zh":
    head = f"你的情绪值现在是 {emotion}，状态是 {state}：{meaning}。"
  else:
    head = f"Your emotion is now {emotion}, state {state}: {meaning}."
  return head + _reply_task(language, passive)


def reference_reply_instruction(state: str, reading: str, language: str, passive: bool) -> str:
  """The reply step of the reference information flow: the state label and the fit and feeling
  parts of this turn's analysis (`reading`; "" when none could be found), never the number."""
  _check(language)
  meaning = _STATE_MEANING[language][state]
  if language == "zh":
    head = f"你现在的状态是 {state}：{meaning}。"
    notes = f"你对对方最新那句话的看法（你自己刚才的记录）：\n{reading}\n\n" if reading else ""
  else:
    head = f"Your state is now {state}: {meaning}."
    notes = f"Your own notes on the other side's latest reply:\n{reading}\n\n" if reading else ""
  return head + _reply_task(language, passive, notes)


def _reply_task(language: str, passive: bool, notes: str = "") -> str:
  """What the reply step asks for after its opening line: the states' legend, `notes`, the task."""
  label = REPLY_LABEL[language]
  meanings = _STATE_MEANING[language]
  if language == "zh":
    legend = "\n".join(f"- {k}：{v}" for k, v in meanings.items())
    extra = "\n你性格被动：不要向对方提问。" if passive else ""
    return (f"\n各状态的含义：\n{legend}\n\n{notes}"
            "现在以这个人的身份回应对方。先简单规划：态度、目标（绝不透露隐藏主题）、语气、要说的内容。"
            f"{extra}\n然后写一版草稿，再改写得像真人说话：简短、情绪含蓄、不重复、不用套话。\n"
            f"最后一行以“{label}：”开头，只写最终的回复；只有这一行会被对方看到。")
  legend = "\n".join(f"- {k}: {v}" for k, v in meanings.items())
  extra = "\nYou are a passive person: do not ask the other side questions." if passive else ""
  return (f"\nWhat the states mean:\n{legend}\n\n{notes}"
          "Now respond to the other side as this person. First plan briefly: attitude, goal (never "
          f"reveal your hidden theme), tone, content.{extra}\nThen write a draft and rewrite it so "
          "it sounds like a real person: short, emotions implied, no repetition, no stock "
          "phrases.\n"
          f"End with a line starting with \"{label}:\" that holds only the final reply; only that line "
          "reaches the other side.")
