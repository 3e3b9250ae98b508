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
That is the "chat" information flow; in the "reference" and "sage" ones (see info_flow) each step's private
answers are rewound out of the context once read, and the transcript keeps only the exchange.

Rows are dialogue ids fixed at construction; every call addresses rows by id, never by position
among the live dialogues (the reference mixes up simulators once some dialogues end).

The answers are read by `parsing`; each dialogue's record (`user_state.UserState`) is written only
here: the rollout reads it and ends a dialogue through `SimulatedUsers.end`.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Sequence

from rlver_jax.env import info_flow as flows
from rlver_jax.env import simulator_prompts as prompts
from rlver_jax.env.backends import SimRequest, SimulatorBackend
from rlver_jax.env.chat import says_goodbye
from rlver_jax.env.parsing import change_value_offset, extract_reply, parse_change
from rlver_jax.env.profiles import Profile, personality_key
from rlver_jax.env.user_rules import UserRules
from rlver_jax.env.user_state import SIMULATOR_ERROR, TERMINATIONS, TurnResult, UserState

# What a user "says" when the simulator gave no usable reply line even after the retries: the text
# before a marker is private planning (it may name the hidden theme) and must not reach the policy.
_SILENT_REPLY = {"en": "...", "zh": "……"}


def _shown(emotion: int | float) -> int | float:
  """The emotion as the prompts state it: an integer as is, an expected-change float to 0.1."""
  return emotion if isinstance(emotion, int) else round(emotion, 1)


class SimulatedUsers:
  """A batch of simulated users, one per profile, driven turn by turn against a backend.

  Call `opening()` once (or `opening(rows)` once per row, whole groups at a time, as rollout rows
  free up), then `step(rows, policy_replies)` with any subset of the live rows. A
  dialogue that ends by emotion (e >= 100 or e < end_below) still gets its final user line (state S
  or F means: say goodbye); one that ends by `max_turns` does not, since nobody would read it.

  `max_turns` counts policy replies per dialogue. A dialogue also ends when the emotion reaches 100
  or falls below `end_below` (1: at 0, the reference's training rule; 10: state F, the benchmark's).
  `clamp_change` limits each stated change to [-10, 10]; `score_guidance` tells the simulator how
  many points a fitting reply earns (see simulator_prompts.emotion_instruction). `change_mode`
  "expected" applies the mean of the simulator's own distribution over the change values where it
  wrote the value (`expected_change`; a backend with `scores_changes` only) instead of the value it
  sampled; emotions are then floats.

  `groups` (one id per row) makes rows with the same id copies of one dialogue state after the
  opening, as GRPO's samples of a profile are: the first row of a group generates the opening (or
  prefills its preset `first_talk`), the others get its record and its backend context
  (`clone_rows`), so every member's simulator and policy see the same first line.

  `info_flow` ("chat", "reference" or "sage", see info_flow) sets what the simulator's steps see of each
  other; with a backend that does not read its context (`reads_context` False) it is "chat".
  """

  def __init__(self, profiles: Sequence[Profile], backend: SimulatorBackend, *,
               groups: Sequence[int] | None = None, **rules):
    self.rules = UserRules(**rules)  # the rules by name (see UserRules), each checked there
    if self.rules.change_mode == "expected" and not getattr(backend, "scores_changes", False):
      raise ValueError(f"simulator.change_mode='expected' needs the co-located model backend "
                       f"(simulator.backend='model'): {backend.server()} gives no distribution "
                       "over the change values")
    self.profiles = list(profiles)
    self.backend = backend
    # The flow this backend can run.
    self.info_flow = self.rules.info_flow if backend.reads_context else "chat"
    self.records = [
        UserState(row=i, profile=p, language=self.rules.language_override or p.language,
                  emotion=self.rules.start_emotion)
        for i, p in enumerate(self.profiles)
    ]
    self._leader = self._group_leaders(groups)
    self._kept = [flows.OPENING_KEPT] * len(self.records)  # per row: messages its transcript keeps
    self._opened: set[int] = set()
    backend.reset(len(self.records))

  @classmethod
  def playing(cls, profiles: Sequence[Profile], backend: SimulatorBackend, rules: UserRules, *,
              groups: Sequence[int] | None = None) -> "SimulatedUsers":
    """A batch driven by `rules` (what the trainer and the evaluations build from their config)."""
    return cls(profiles, backend, groups=groups, **dataclasses.asdict(rules))

  def _group_leaders(self, groups: Sequence[int] | None) -> list[int]:
    """Per row, the first row of its group (itself without groups)."""
    if groups is None:
      return list(range(len(self.records)))
    groups = list(groups)
    if len(groups) != len(self.records):
      raise ValueError(f"{len(groups)} group ids for {len(self.records)} profiles")
    first: dict = {}
    leaders = [first.setdefault(g, row) for row, g in enumerate(groups)]
    for row, lead in enumerate(leaders):
      if self.records[row].profile.id != self.records[lead].profile.id:
        raise ValueError(f"rows {lead} and {row} share group {groups[row]} but not their profile "
                         f"({self.records[lead].profile.id!r} vs {self.records[row].profile.id!r})")
    return leaders

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

  def end(self, row: int, termination: str) -> None:
    """Ends a live dialogue for a reason outside the simulator (the policy's context is full)."""
    if termination not in TERMINATIONS:
      raise ValueError(f"unknown termination {termination!r}; expected one of {TERMINATIONS}")
    if self.records[row].done:
      raise ValueError(f"dialogue {row} already ended ({self.records[row].termination})")
    self.records[row].termination = termination

  def release(self, row: int) -> None:
    """An ended dialogue gives up its backend row (a model backend's cache row is lent anew)."""
    if not self.records[row].done:
      raise ValueError(f"dialogue {row} is still running; only an ended one releases its row")
    self.backend.release(row)

  def opening(self, rows: Sequence[int] | None = None) -> list[str]:
    """The users' first utterances for `rows` (default all; preset `first_talk`, else generated).
    A group's rows start together: its members copy the leader's opening."""
    rows = list(range(len(self.records))) if rows is None else [operator.index(r) for r in rows]
    started = self._opened.intersection(rows)
    if started:
      raise RuntimeError(f"opening() was already called for dialogue {min(started)}")
    missing = [r for r in rows if self._leader[r] not in rows]
    if missing:
      raise ValueError(f"dialogue {missing[0]} starts without its group's first dialogue "
                       f"{self._leader[missing[0]]}: a group's dialogues start together")
    self._opened.update(rows)
    to_generate = []
    for rec in (self.records[r] for r in rows):
      rec.messages.append({"role": "system",
                           "content": prompts.system_prompt(rec.profile, self.rules.style, rec.language)})
      rec.messages.append({"role": "user", "content": prompts.opening_instruction(
          rec.language, self._passive(rec))})
      if rec.profile.first_talk:
        # Kept in the context; it reaches the backend with the first emotion step (or, for a
        # group, is prefilled now so the members copy it).
        rec.messages.append({"role": "assistant", "content": rec.profile.first_talk})
        rec.replies.append(rec.profile.first_talk)
        self._kept[rec.row] += 1
      elif self._leader[rec.row] == rec.row:
        to_generate.append(rec)
    lines, _ = self._speak(to_generate, "opening")
    for rec in to_generate:
      # A context already full gets the silent line here; its first step ends it (context_full).
      rec.replies.append(lines.get(rec.row) or self._silent(rec))
    self._forget(to_generate, keep_line=True)
    copies = {row: self._leader[row] for row in rows if self._leader[row] != row}
    self._send_unsent(sorted(set(copies.values())))
    if copies:
      self.backend.clone_rows(copies)
      for dst, src in copies.items():
        rec, lead = self.records[dst], self.records[src]
        rec.messages = [dict(m) for m in lead.messages]
        # The line (silent or not) is the member's too; the failed generations were the leader's,
        # and so is a failed request (the member shares the opening it never got).
        rec.sent, rec.replies, rec.silent_replies = lead.sent, list(lead.replies), lead.silent_replies
        rec.termination = lead.termination
        self._kept[dst] = self._kept[src]
    return [self.records[r].replies[0] for r in rows]

  def _send_unsent(self, rows: Sequence[int]) -> None:
    """Gives the backend the rows' messages it has not had yet, without generating."""
    pending = {row: self.records[row].messages[self.records[row].sent:] for row in rows
               if not self.records[row].done}
    pending = {row: new for row, new in pending.items() if new}
    if pending:
      self.backend.prefill(pending)
      for row in pending:
        self.records[row].sent = len(self.records[row].messages)

  def _forget(self, recs: list[UserState], keep_line: bool = False) -> None:
    """Reference flow: rewinds the rows' private answers out of the context (back to the end of
    their transcript); with `keep_line`, the user's new visible line then joins the transcript (it
    is sent with the row's next request). Ended or full rows are left as they are."""
    if self.info_flow == "chat":
      return
    recs = [rec for rec in recs if rec.termination not in (SIMULATOR_ERROR, "context_full")
            and not self._full(rec.row)]
    if not recs:
      return
    self.backend.rewind({rec.row: self._kept[rec.row] for rec in recs})
    for rec in recs:
      del rec.messages[self._kept[rec.row]:]
      rec.sent = len(rec.messages)
      if keep_line:
        rec.messages.append({"role": "assistant", "content": rec.replies[-1]})
        self._kept[rec.row] += 1

  def step(self, rows: Sequence[int], policy_replies: Sequence[str]) -> list[TurnResult]:
    """One policy turn for the given dialogue ids: emotion step (with retries), then reply step."""
    recs = self._check_rows(rows, policy_replies)
    for rec, reply in zip(recs, policy_replies):
      rec.policy_replies.append(reply)
      new, kept = flows.emotion_messages(self.info_flow, reply, _shown(rec.emotion), rec.language,
                                         self.rules.style, self.rules.score_guidance,
                                         self.rules.change_range)
      self._kept[rec.row] = len(rec.messages) + kept
      rec.messages += new
    changes, failures, analyses = self._emotion_step(recs)
    self._forget(recs)
    for rec in recs:
      rec.reasoning.append(analyses.get(rec.row, ""))
      rec.apply(changes.get(rec.row))
      if rec.termination == SIMULATOR_ERROR:  # its request failed: ended, without a reply
        continue
      # A simulator out of context cannot judge or answer: the dialogue ends where it stands.
      full = self._full(rec.row)
      rec.termination = ("context_full" if full
                         else rec.emotion_termination(self.rules.max_turns, self.rules.end_below,
                                                      self.rules.end_above))
    speaking = [rec for rec in recs
                if rec.termination not in ("max_turns", "context_full", SIMULATOR_ERROR)]
    for rec in speaking:
      rec.messages.append(flows.reply_message(self.info_flow, analyses.get(rec.row, ""), _shown(rec.emotion),
                                              rec.state, rec.language, self._passive(rec)))
    lines, reply_failures = self._speak(speaking, "reply")
    user_replies: dict[int, str] = {}
    for rec in speaking:
      if rec.termination == SIMULATOR_ERROR:
        continue
      if self._full(rec.row):  # no room for the reply: end without one
        rec.termination = rec.termination or "context_full"
        continue
      reply = lines.get(rec.row) or self._silent(rec)
      rec.replies.append(reply)
      user_replies[rec.row] = reply
      if rec.termination is None and says_goodbye(reply, rec.language, self.rules.goodbye_match):
        rec.termination = "goodbye"
    self._forget([rec for rec in speaking if rec.row in user_replies], keep_line=True)
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
    def parse(text):
      return parse_change(text, clamp=self.rules.clamp_change)
    def retry(language):
      return prompts.retry_instruction(language, self.rules.change_range)
    changes, failures, analyses = self._ask(recs, "emotion", "retry", parse, retry)
    if self.rules.change_mode == "expected":
      changes = self._expected_changes(changes, analyses)
    for rec in recs:
      rec.parse_failures += failures[rec.row]
    return changes, failures, analyses

  def _expected_changes(self, changes: dict, analyses: dict[int, str]) -> dict:
    """The backend's expected change for each row whose analysis has a readable value; the others
    keep theirs (None: unread)."""
    offsets = {row: change_value_offset(analyses[row]) for row, c in changes.items() if c is not None}
    expected = self.backend.expected_changes(offsets) if offsets else {}
    return {row: expected.get(row, c) for row, c in changes.items()}

  def _speak(self, recs: list[UserState], kind: str):
    """Generates user lines, re-asking only the rows whose answer had no usable reply line.

    Returns the lines by row (None: still none after `max_parse_retries` retries, or the context
    is full) and the failures per row. A truncated answer is treated like any other: if it holds a
    reply marker the (possibly cut) line after it is used, else the row is asked again.
    """
    lines, failures, _ = self._ask(recs, kind, "reply_retry", extract_reply,
                                   prompts.reply_retry_instruction)
    for rec in recs:
      rec.reply_failures += failures[rec.row]
    return lines, failures

  def _ask(self, recs: list[UserState], kind: str, retry_kind: str,
           parse: Callable[[str], object], retry_prompt: Callable[[str], str]):
    """Generates for `recs`, then re-asks (up to `max_parse_retries` times, a `retry_prompt` in the
    row's append-only context) only the rows whose answer `parse` turns into None. A full row is
    not retried. Returns (parsed by row, failures by row this call, last text by row)."""
    parsed: dict[int, object] = {}
    failures = {rec.row: 0 for rec in recs}
    texts: dict[int, str] = {}
    pending = recs
    for attempt in range(self.rules.max_parse_retries + 1):
      failed = []
      for rec, text in zip(pending, self._generate(pending, kind)):
        if text is None:  # the backend gave up on this row: its dialogue has ended
          continue
        texts[rec.row] = text
        parsed[rec.row] = parse(text)
        if parsed[rec.row] is None and not self._full(rec.row):  # full: nothing to retry
          failures[rec.row] += 1
          failed.append(rec)
      if not failed or attempt == self.rules.max_parse_retries:
        break
      for rec in failed:
        rec.messages.append({"role": "user", "content": retry_prompt(rec.language)})
      pending, kind = failed, retry_kind
    return parsed, failures, texts

  def _silent(self, rec: UserState) -> str:
    """The line shown in place of a reply that never came (counted unless the context is full)."""
    if not self._full(rec.row) and rec.termination != SIMULATOR_ERROR:
      rec.silent_replies += 1
    return _SILENT_REPLY.get(rec.language, _SILENT_REPLY["en"])

  def _full(self, row: int) -> bool:
    return bool(self.backend.is_full(row))

  def _generate(self, recs: list[UserState], kind: str) -> list[str | None]:
    """Sends each row its unsent messages, records the answers in the rows' contexts. A row whose
    request failed (None) ends as SIMULATOR_ERROR."""
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
      if text is None:
        rec.termination = SIMULATOR_ERROR
        out.append(None)
        continue
      text = text if isinstance(text, str) else str(text)
      rec.messages.append({"role": "assistant", "content": text})
      rec.sent = len(rec.messages)
      out.append(text)
    return out

  def _check_rows(self, rows: Sequence[int], policy_replies: Sequence[str]) -> list[UserState]:
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
      if row not in self._opened:
        raise RuntimeError(f"dialogue {row} has not started: call opening() for it before step()")
    return [self.records[row] for row in rows]

  @staticmethod
  def _passive(rec: UserState) -> bool:
    try:
      return personality_key(rec.profile) == "passive"
    except ValueError:  # a custom personality type: no special rule
      return False
