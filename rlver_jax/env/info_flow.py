"""What the simulated user's steps see of each other (config `simulator.info_flow`).

- "chat": one growing chat per dialogue. Every step sees every earlier analysis, plan and draft of
  the simulator, and the reply step sees the emotion number.
- "reference": as the RLVER reference. The context that persists between turns is a clean
  transcript: the system prompt, the opening request and the opening line alone, then per turn the
  policy's reply (quoted) and the user's visible line. The emotion step appends its request (with
  the current emotion) to that transcript; the reply step appends instead a request holding only the
  state label and the fit and feeling sections of this turn's analysis. Each step's private answers
  (analyses, plans, drafts, corrections) are rewound out of the context once they are read
  (`SimulatorBackend.rewind`), so the context stays append-only and a model backend never
  re-prefills: after a turn its KV rows hold exactly the transcript.
- "sage": as the SAGE benchmark's simulator: the reference flow, but the reply step's request also
  holds the inner-reaction section (SAGE passes its target-completion, activity and analysis
  parts: fit, inner reaction and feeling here).

Backends: the co-located model rewinds its KV rows; the HTTP backend re-sends each row's message
list, so it posts the same messages; the scripted rules do not read the context
(`reads_context` False), so with them the option does nothing.
"""
from __future__ import annotations

from rlver_jax.env import simulator_prompts as prompts
from rlver_jax.env.backends import Message
from rlver_jax.env.parsing import before_change_label, labelled_sections

INFO_FLOWS = ("chat", "reference", "sage")
# The analysis sections (simulator_prompts.ANALYSIS_LABELS indices) each flow's reply step reads.
READ_SECTIONS = {"reference": prompts.READ_SECTIONS, "sage": (1, 2, 3)}
# Messages of the opening a reference transcript keeps: the system prompt and the opening request
# (the answer is replaced by its line alone).
OPENING_KEPT = 2


def check(info_flow: str) -> None:
  if info_flow not in INFO_FLOWS:
    raise ValueError(f"unknown info_flow {info_flow!r}; expected one of {INFO_FLOWS}")


def _user(content: str) -> Message:
  return {"role": "user", "content": content}


def emotion_messages(info_flow: str, policy_reply: str, emotion: int, language: str, style: str,
                     guidance: bool, change_range: int = 10) -> tuple[list[Message], int]:
  """The emotion step's new messages, and how many of them (from the front) stay in the context."""
  if info_flow == "chat":
    return [_user(prompts.emotion_instruction(policy_reply, emotion, language, style, guidance,
                                              change_range))], 1
  return [_user(prompts.other_side_said(policy_reply, language)),
          _user(prompts.emotion_request(emotion, language, style, guidance, change_range))], 1


def reply_message(info_flow: str, analysis: str, emotion: int, state: str, language: str,
                  passive: bool) -> Message:
  """The reply step's request: with the number (chat), or with the state label and the reading."""
  if info_flow == "chat":
    return _user(prompts.reply_instruction(emotion, state, language, passive))
  return _user(prompts.reference_reply_instruction(
      state, reading(analysis, language, READ_SECTIONS[info_flow]), language, passive))


def reading(analysis: str, language: str, read: tuple[int, ...] = prompts.READ_SECTIONS) -> str:
  """The analysis's sections `read` (ANALYSIS_LABELS indices; default: fit and feeling), each under
  its label ("" when none is there).

  Each is cut at a change label, so a change written on a section's own line stays out too.
  """
  labels = prompts.ANALYSIS_LABELS[language]
  sections = labelled_sections(analysis, labels + (prompts.CHANGE_LABEL[language],))
  colon = "：" if language == "zh" else ": "
  out = []
  for i in read:
    body = before_change_label(sections.get(labels[i], ""))
    if body:
      out.append(f"{labels[i]}{colon}{body}")
  return "\n".join(out)
