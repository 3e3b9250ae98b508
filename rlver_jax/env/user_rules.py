"""The rules a batch of simulated users plays by, as one checked value.

Training (config.simulator), the held-out evaluation and the Sentient benchmark (config.eval's start
emotion, turns and end, with config.simulator's style and simulator rules) each build one with
`SimulatorSpec.user_rules`, and `SimulatedUsers.playing` drives a batch by it, so a new rule is added
in one place and reaches every caller.
"""
from __future__ import annotations

import dataclasses

from rlver_jax.env import info_flow as flows
from rlver_jax.env import simulator_prompts as prompts
from rlver_jax.env.chat import GOODBYE_MATCHES
from rlver_jax.env.expected_change import CHANGE_MODES
from rlver_jax.env.user_state import end_below_need, start_emotion_need


@dataclasses.dataclass(frozen=True)
class UserRules:
  """See `SimulatedUsers` for what each rule does."""
  style: str = "vanilla"
  start_emotion: int = 30
  max_turns: int = 8
  max_parse_retries: int = 2
  language_override: str | None = None
  end_below: int = 1
  clamp_change: bool = True
  score_guidance: bool = False
  info_flow: str = "chat"
  change_mode: str = "sampled"
  change_range: int = 10      # the range [-N, N] the emotion prompt states; 0 = none stated
  end_above: int = 100        # ends a dialogue at emotion >= this; 0 = never
  goodbye_match: str = "clause"

  def __post_init__(self):
    if self.style not in prompts.STYLES:
      raise ValueError(f"unknown simulator style {self.style!r}; expected one of {prompts.STYLES}")
    if self.language_override is not None and self.language_override not in prompts.LANGUAGES:
      raise ValueError(
          f"unknown language {self.language_override!r}; expected one of {prompts.LANGUAGES}")
    flows.check(self.info_flow)
    if self.goodbye_match not in GOODBYE_MATCHES:
      raise ValueError(f"goodbye_match={self.goodbye_match!r}: must be one of {GOODBYE_MATCHES}")
    if self.change_range < 0 or not 0 <= self.end_above <= 100:
      raise ValueError(f"need change_range >= 0 and end_above in [0, 100] (got "
                       f"{self.change_range}, {self.end_above})")
    if self.max_turns < 1 or self.max_parse_retries < 0:
      raise ValueError(f"need max_turns >= 1 and max_parse_retries >= 0 (got {self.max_turns}, "
                       f"{self.max_parse_retries})")
    if self.change_mode not in CHANGE_MODES:
      raise ValueError(f"simulator.change_mode={self.change_mode!r}: must be one of {CHANGE_MODES}")
    for name, value, need in (("start_emotion", self.start_emotion, start_emotion_need(self.start_emotion)),
                              ("end_below", self.end_below, end_below_need(self.end_below))):
      if need:
        raise ValueError(f"{name}={value}: must be {need}")
