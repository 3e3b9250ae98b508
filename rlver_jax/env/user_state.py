"""One simulated user's record (emotion, changes, replies, ending) and the emotion rules.

The simulator (`simulator.SimulatedUsers`) is the only writer of these records; the rollout and
the evaluations read them.
"""
from __future__ import annotations

import dataclasses

from rlver_jax.env.backends import Message
from rlver_jax.env.profiles import Profile

# simulator_error: a request to the backend failed within its retry bound (the run goes on).
SIMULATOR_ERROR = "simulator_error"
TERMINATIONS = ("goodbye", "emotion_zero", "emotion_low", "emotion_full", "max_turns",
                "context_full", "history_long", SIMULATOR_ERROR)


def start_emotion_need(value: int) -> str | None:
  """None when `value` can start a dialogue, else what it must be (the one statement of the range:
  the simulator and the run spec both use it)."""
  return None if 0 <= value <= 100 else "in [0, 100]"


def end_below_need(value: int) -> str | None:
  """None when a dialogue can end once its emotion drops below `value`, else what it must be."""
  return None if 1 <= value <= 100 else "in [1, 100] (1: end at 0)"


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

  @property
  def turn_rewards(self) -> list[float]:
    """Per policy turn, the emotion's actual move / 100 (the stated change is clipped to [0, 100]
    when applied), so they sum to (final - start) / 100."""
    return [(after - before) / 100.0 for before, after in zip(self.emotions, self.emotions[1:])]

  def apply(self, change: int | None) -> int:
    """Records one emotion update (a parse failure, None, means change 0); returns the change."""
    applied = 0 if change is None else change
    self.changes.append(applied)
    self.parsed.append(change is not None)
    self.emotion = apply_change(self.emotion, applied)
    self.emotions.append(self.emotion)
    return applied

  def emotion_termination(self, max_turns: int, end_below: int = 1,
                          end_above: int = 100) -> str | None:
    """The ending forced by the emotion value (>= `end_above`, 0 = never; or below `end_below`) or
    the turn budget."""
    if end_above and self.emotion >= end_above:
      return "emotion_full"
    if self.emotion <= 0:
      return "emotion_zero"
    if self.emotion < end_below:
      return "emotion_low"
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

