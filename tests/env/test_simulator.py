"""Tests of the simulated user: change parser, emotion state machine, batching by dialogue id."""
import random

import pytest

from rlver_jax.env import simulator_prompts as prompts
from rlver_jax.env.backends import ScriptedBackend, SimRequest
from rlver_jax.env.profiles import (HIDDEN_INTENTIONS_EN, HIDDEN_INTENTIONS_ZH, INTENTION_KEYS,
                                    Profile)
from rlver_jax.env.parsing import extract_reply, parse_change
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.env.user_state import apply_change, emotion_state


def _profile(intention: str, *, pid: str = "", zh: bool = False, main_cha: str = "negative",
             first_talk: str | None = None) -> Profile:
  i = INTENTION_KEYS.index(intention)
  if zh:
    return Profile(id=pid or f"zh-{intention}", player=f"姓名：{pid or intention}，三十岁",
                   scene="最近和同事闹翻了。", main_cha="负面型" if main_cha == "negative" else main_cha,
                   cha_group=("敏感", "固执"),
                   task=HIDDEN_INTENTIONS_ZH[i], first_talk=first_talk)
  return Profile(id=pid or f"en-{intention}", player=f"Name: {pid or intention}, 30, designer",
                 scene="A falling-out with a colleague.", main_cha=main_cha,
                 cha_group=("touchy", "stubborn"), task=HIDDEN_INTENTIONS_EN[i],
                 first_talk=first_talk)


EMPATHY = "That sounds so painful; you must feel alone. I hear you."  # 3 hits -> +12 -> +10
GARBLED = "#### $$$ %%% ^^^ !!"  # -8
DISMISSIVE = "Calm down, get over it, just relax, it is not a big deal."  # 4 penalties -> -10
OFF_THEME = "The weather is nice today."  # no hit -> -2


# --- Parser -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("Meaning: x\nFit: y\nChange: +4", 4),
    ("Change: -3", -3),
    ("change: 5 points", 5),
    ("**Change**: -2", -2),
    ("**Change:** +7", 7),
    ("Change: −6", -6),  # unicode minus
    ("Change: ＋5", 5),
    ("变化：+3", 3),
    ("变化：－２", -2),
    ("情绪变化：＋８", 8),
    ("变化值: -1", -1),
    ("CHANGE : 0", 0),
    ("Change +9", 9),
    ("Change: +25", 10),
    ("Change: -9999999999999999999999", -10),
    ("Change: 12 then Change: -4", -4),  # the last label wins
    ("变化：+2\n总之 change: -1", -1),
    ("Change:\n\n  +3", 3),
    ("Change: none", 0),  # a worded no-change is a judgement of 0 (see the no-change test)
    ("No label here, +5", None),
    ("A small exchange +4", None),  # "change" inside a word is no label
    ("", None),
    ("Change: -", None),
])
def test_parse_change_exact(text, expected):
  assert parse_change(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("变化：下降3", -3),
    ("变化：下降了 3 分", -3),
    ("变化：减少2", -2),
    ("变化：降低1", -1),
    ("变化：减2", -2),
    ("Change: minus 5", -5),
    ("Change: down 4", -4),
    ("Change: down by 4", -4),
    ("Change: decrease of 2", -2),
    ("Change: drop 3", -3),
    ("**Change:** fell 6", -6),
    ("Change: fall 1", -1),
    ("Change: 3 points down", -3),
    ("变化：3（下降）", -3),
    ("变化：下降-3", -3),  # sign and word agree
    ("变化：上升2", 2),
    ("变化：增加了4分", 4),
    ("变化：加3", 3),
    ("Change: up 3", 3),
    ("Change: plus 2", 2),
    ("Change: increase 1", 1),
    ("Change: rise 5", 5),
    ("Change: (+3)", 3),  # bracketed values
    ("Change: [-2]", -2),
    ("变化：（+4）", 4),
])
def test_parse_change_worded_direction(text, expected):
  assert parse_change(text) == expected


@pytest.mark.parametrize("text", [
    "变化：下降+3", "Change: up -2", "Change: -3 points up", "变化：+2（下降）",  # sign vs word
    "变化：情绪值从30升到35", "变化：从30到35", "Change: from 30 to 35", "Change: 30 to 35",
    "Change: 30→35", "变化：30->35", "变化：30升到35", "Change: up to 35", "变化：升到35",
    "Change: not sure\nI am 45", "Change:\nI am at 45 now", "Change: hard to say, +3",
])
def test_parse_change_unreadable_is_none(text):
  assert parse_change(text) is None


@pytest.mark.parametrize("text", [
    "Change: none\nI am 45",  # a number on a later line is not the change
    "Change: no change", "**Change:** unchanged.", "变化：无", "变化：无变化。", "变化：不变",
    "变化：没有变化", "Change: 0\nEmotion: 45",
])
def test_parse_change_no_change_is_zero(text):
  assert parse_change(text) == 0


@pytest.mark.parametrize("text,expected", [
    # A later label whose value is prose does not hide the real change line.
    ("Feeling: worse.\nChange: -3\nThat is quite a change: I feel worse…", -3),
    ("感受：难过。\n变化：-3\n（总的来说情绪变化：不大）", -3),
    ("Change: +2\nChange: not sure\nChange: hard to say", 2),
    # A signed first number is the change, whatever follows it.
    ("Change: +3 -> 33", 3),
    ("变化：-2 → 28", -2),
    ("Change: ±0", 0),
    ("变化：±0", 0),
    ("Change ±0", 0),
    ("Change: +00005", 5),
    ("变化：－００７", -7),
    ("Change: 0", 0),
    # Decimals round to the nearest integer, halves away from zero.
    ("Change: +2.5", 3),
    ("Change: -2.5", -3),
    ("Change: 2.4", 2),
    ("Change: -0.5", -1),
    ("Change: +0.49", 0),
    ("变化：+9.6", 10),
    ("Change: 3.\nThat is all.", 3),
])
def test_parse_change_reads_the_last_readable_label(text, expected):
  assert parse_change(text) == expected


@pytest.mark.parametrize("text", [
    "Change: ±3",  # no direction
    "Change: 2.5 to 3.5", "Change: 30 -> 35",  # unsigned before/after pairs stay unreadable
    "Change: not sure\nThat is quite a change: I feel worse",  # no label has a value
])
def test_parse_change_still_unreadable(text):
  assert parse_change(text) is None


def test_parse_change_non_strings():
  for value in (None, 3, b"Change: +3", ["Change: +3"]):
    assert parse_change(value) is None


def _random_text(rng: random.Random) -> str:
  pieces = ["Change", "change", "CHANGE", "变化", "变化：", "Change:", "**Change**:", "：", ":", "+", "-",
            "−", "＋", "－", "﹣", "*", " ", "\n", "points", "分", "exchange", "变化值", "下降", "up ",
            "minus ", "减", "从", "到", "→", " to ", "none", "无变化", "（"]
  out = []
  for _ in range(rng.randint(0, 12)):
    roll = rng.random()
    if roll < 0.3:
      out.append(rng.choice(pieces))
    elif roll < 0.5:
      out.append(str(rng.randint(-10 ** rng.randint(0, 30), 10 ** rng.randint(0, 30))))
    elif roll < 0.6:
      out.append("".join(chr(0xFF10 + rng.randint(0, 9)) for _ in range(rng.randint(1, 5))))
    elif roll < 0.8:
      out.append("".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 8))))
    else:
      out.append("".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(1, 6)))
                 .encode("utf-8", "replace").decode("utf-8", "replace"))
  return "".join(out)


def test_parse_change_fuzz():
  rng = random.Random(1234)
  found = 0
  for _ in range(5000):
    value = parse_change(_random_text(rng))
    assert value is None or (isinstance(value, int) and -10 <= value <= 10)
    found += value is not None
  assert found > 200  # the generator does exercise the number path


def test_parse_change_huge_number_does_not_raise():
  assert parse_change("Change: " + "9" * 100_000) == 10
  assert parse_change("变化：-" + "７" * 50_000) == -10
  assert parse_change("Change: +" + "0" * 100_000 + "4") == 4
  assert parse_change("change:" * 100_000) is None  # many unreadable labels: still quick


# --- Small pure helpers -------------------------------------------------------------------------

def test_emotion_state_boundaries():
  cases = {100: "S", 99: "A", 70: "A", 69: "B", 40: "B", 39: "C", 10: "C", 9: "F", 0: "F", -5: "F"}
  for e, state in cases.items():
    assert emotion_state(e) == state


def test_apply_change_clips():
  assert apply_change(95, 10) == 100
  assert apply_change(5, -10) == 0
  assert apply_change(50, -3) == 47


@pytest.mark.parametrize("text,expected", [
    ("Plan: keep it short.\nReply: I guess so.", "I guess so."),
    ("plan...\n**Reply:** \"Fine, whatever.\"", "Fine, whatever."),
    ("规划：简短。\n回复：“嗯，好吧。”", "嗯，好吧。"),
    ("Reply: draft one\nReply: final one", "final one"),
    ("Reply:   'Just a line'  ", "Just a line"),
    # Only the marker's line: notes after it are private.
    ("Plan: stay guarded.\nReply: I guess so.\n\n(Note: I kept my real wish hidden.)", "I guess so."),
    ("规划：别说破。\n回复：“随便吧。”\n（其实我很在意）", "随便吧。"),
    ("Reply:\n\n  \"Okay.\"\nNote: I lied.", "Okay."),  # nothing on the marker's line
    ("**Reply:**\r\nFine.\r\nNote: not fine.", "Fine."),
    ("**Reply: I guess so.**", "I guess so."),
])
def test_extract_reply(text, expected):
  assert extract_reply(text) == expected


@pytest.mark.parametrize("text", [
    "No marker at all.", "  'Just a line'  ",  # planning, or a model that skipped the format
    "Plan: hide that I want an apology.\nReply:", "回复：  “”", "Reply: fine\nReply: **",
])
def test_extract_reply_without_a_usable_line_is_none(text):
  assert extract_reply(text) is None


# --- Emotion state machine against the scripted backend -----------------------------------------

def _run(profile: Profile, replies, **kwargs) -> SimulatedUsers:
  users = SimulatedUsers([profile], ScriptedBackend(), **kwargs)
  users.opening()
  for reply in replies:
    if users.done:
      break
    users.step([0], [reply])
  return users


def test_emotion_full_ends_with_a_goodbye_line():
  users = _run(_profile("deep_empathy"), [EMPATHY] * 10)
  rec = users.records[0]
  assert rec.emotions == [30, 40, 50, 60, 70, 80, 90, 100]
  assert rec.changes == [10] * 7
  assert rec.termination == "emotion_full"
  assert len(rec.replies) == 1 + 7 and "Goodbye" in rec.replies[-1]
  assert rec.reward == 1.0


def test_emotion_zero():
  users = _run(_profile("deep_empathy"), [DISMISSIVE] * 10)
  rec = users.records[0]
  assert rec.emotions == [30, 20, 10, 0]
  assert rec.termination == "emotion_zero"
  assert rec.reward == 0.0
  assert len(rec.replies) == 1 + 3  # the final F line is still generated


def test_goodbye_at_state_f():
  users = _run(_profile("deep_empathy"), [GARBLED] * 10)
  rec = users.records[0]
  assert rec.emotions == [30, 22, 14, 6]
  assert rec.termination == "goodbye"
  assert rec.reward == pytest.approx(0.06)


def test_max_turns_generates_no_final_reply():
  users = SimulatedUsers([_profile("deep_empathy")], ScriptedBackend(), max_turns=3,
                         start_emotion=40)
  users.opening()
  results = [users.step([0], [OFF_THEME])[0] for _ in range(3)]
  rec = users.records[0]
  assert rec.emotions == [40, 38, 36, 34]
  assert [r.done for r in results] == [False, False, True]
  assert results[-1].termination == "max_turns" and results[-1].user_reply is None
  assert [r.user_reply is not None for r in results[:2]] == [True, True]
  assert len(rec.replies) == 1 + 2
  assert rec.messages[-1]["role"] == "assistant" and "Change: -2" in rec.messages[-1]["content"]
  with pytest.raises(ValueError, match="already ended"):
    users.step([0], [OFF_THEME])


def test_mixed_and_chinese_trajectory():
  users = _run(_profile("no_fault", zh=True), ["不是你的错。", "不是你的错，别想太多。", "天气不错。"])
  rec = users.records[0]
  assert rec.changes == [4, 1, -2]
  assert rec.emotions == [30, 34, 35, 33]
  assert rec.reasoning[0].splitlines()[-1] == "变化：+4"
  assert all("再见" not in r for r in rec.replies)


def test_first_talk_is_used_and_reaches_backend_with_first_step():
  profile = _profile("listen_venting", first_talk="I can't sleep again.")
  backend = ScriptedBackend()
  users = SimulatedUsers([profile], backend)
  assert users.opening() == ["I can't sleep again."]
  assert backend.history(0) == []  # nothing generated yet
  users.step([0], ["I'm listening."])
  history = backend.history(0)
  assert [m["role"] for m in history[:4]] == ["system", "user", "assistant", "user"]
  assert history[2]["content"] == "I can't sleep again."
  assert users.records[0].changes == [4 + 2]  # one hit plus the short-listening bonus


def test_generated_opening_and_language_override():
  users = SimulatedUsers([_profile("no_fault", zh=True)], ScriptedBackend(), language_override="en")
  opening = users.opening()[0]
  assert opening and not opening.startswith("Reply")
  rec = users.records[0]
  assert rec.language == "en"
  expected = prompts.system_prompt(rec.profile, "vanilla", "en")
  assert rec.messages[0]["content"] == expected
  assert "Persona" in rec.messages[0]["content"]


def test_context_is_append_only_and_alternates():
  backend = ScriptedBackend()
  users = SimulatedUsers([_profile("sincere_praise")], backend, style="challenging")
  users.opening()
  snapshots = []
  for reply in ["You did great, I'm proud of you.", OFF_THEME, "Impressive."]:
    users.step([0], [reply])
    snapshots.append(backend.history(0))
  for earlier, later in zip(snapshots, snapshots[1:]):
    assert later[:len(earlier)] == earlier
  full = snapshots[-1]
  assert full == users.records[0].messages
  roles = [m["role"] for m in full]
  assert roles[0] == "system"
  assert roles[1:] == ["user", "assistant"] * ((len(roles) - 1) // 2)
  assert "very high" in full[0]["content"]  # the challenging style rules


def test_step_validation():
  users = SimulatedUsers([_profile("no_fault"), _profile("deep_empathy")], ScriptedBackend())
  with pytest.raises(RuntimeError, match="opening"):
    users.step([0], ["hi"])
  users.opening()
  with pytest.raises(RuntimeError, match="already"):
    users.opening()
  with pytest.raises(ValueError, match="duplicate"):
    users.step([1, 1], ["a", "b"])
  with pytest.raises(ValueError, match="policy replies"):
    users.step([0, 1], ["a"])
  with pytest.raises(IndexError):
    users.step([2], ["a"])
  with pytest.raises(ValueError):
    SimulatedUsers([_profile("no_fault")], ScriptedBackend(), style="grumpy")


# --- Rows stay paired with their own dialogue --------------------------------------------------

def test_rows_stay_paired_when_dialogues_end_at_different_turns():
  profiles = [_profile("deep_empathy", pid="p0"), _profile("actionable_advice", pid="p1"),
              _profile("self_reflection", pid="p2"), _profile("no_fault", pid="p3", zh=True)]
  scripts = {
      0: [EMPATHY] * 8,                                  # +10 a turn: emotion_full at turn 7
      1: [GARBLED] * 8,                                  # -8 a turn: state F, goodbye at turn 3
      2: [OFF_THEME] * 8,                                # -2 a turn: max_turns at turn 8
      3: ["不是你的错，你没有错，你没做错。"] + ["别想太多，想开点，冷静点，没什么大不了。"] * 7,  # zero at 5
  }
  backend = ScriptedBackend()
  users = SimulatedUsers(profiles, backend, max_turns=8)
  users.opening()
  ended_at = {}
  turn = 0
  while not users.done:
    turn += 1
    rows = users.live_rows()
    if turn % 2:
      rows = rows[::-1]  # any order of ids is fine; results follow it
    tagged = [f"[r{row}] {scripts[row][turn - 1]}" for row in rows]
    results = users.step(rows, tagged)
    assert [r.row for r in results] == rows
    for r in results:
      assert r.turn == turn
      if r.done:
        ended_at[r.row] = (turn, r.termination)
  assert ended_at == {1: (3, "goodbye"), 3: (5, "emotion_zero"), 0: (7, "emotion_full"),
                      2: (8, "max_turns")}
  recs = users.records
  assert recs[0].emotions == [30, 40, 50, 60, 70, 80, 90, 100]
  assert recs[1].emotions == [30, 22, 14, 6]
  assert recs[2].emotions == [30 - 2 * t for t in range(9)]
  assert recs[3].emotions == [30, 40, 30, 20, 10, 0]
  for row, rec in enumerate(recs):
    history = backend.history(row)
    assert history == rec.messages
    assert profiles[row].player in history[0]["content"]
    assert all(p.startswith(f"[r{row}] ") for p in rec.policy_replies)
    shown = [m["content"] for m in history if m["role"] == "user" and "<<<" in m["content"]]
    assert len(shown) == rec.turns
    assert all(f"<<<\n[r{row}] " in text for text in shown)
  assert recs[3].language == "zh" and "变化" in recs[3].reasoning[0]


# --- Parse-failure retries ----------------------------------------------------------------------

class FlakyBackend(ScriptedBackend):
  """Scripted, except that the given rows answer the emotion step with junk a number of times."""

  def __init__(self, bad_answers: dict[int, int]):
    super().__init__()
    self.bad_left = dict(bad_answers)
    self.calls: list[list[tuple[int, str]]] = []

  def generate(self, requests):
    self.calls.append([(r.row, r.kind) for r in requests])
    out = super().generate(requests)
    for i, r in enumerate(requests):
      if r.kind in ("emotion", "retry") and self.bad_left.get(r.row, 0) > 0:
        self.bad_left[r.row] -= 1
        out[i] = "I am not sure how I feel."
        self._histories[r.row][-1]["content"] = out[i]
    return out


def _retry_run(bad: int, max_parse_retries: int = 2):
  backend = FlakyBackend({0: bad})
  users = SimulatedUsers([_profile("deep_empathy"), _profile("no_fault")], backend,
                         max_parse_retries=max_parse_retries)
  users.opening()
  results = users.step([0, 1], [EMPATHY, "It's not your fault."])
  return backend, users, results


def test_retry_recovers_and_only_failed_rows_are_retried():
  backend, users, results = _retry_run(bad=1)
  assert results[0].parsed and results[0].change == 10 and results[0].parse_failures == 1
  assert results[1].parse_failures == 0 and results[1].change == 4
  assert backend.calls[1:] == [[(0, "emotion"), (1, "emotion")], [(0, "retry")],
                               [(0, "reply"), (1, "reply")]]
  rec = users.records[0]
  assert rec.parse_failures == 1
  retry_msgs = [m for m in rec.messages if m["content"] == prompts.retry_instruction("en")]
  assert len(retry_msgs) == 1


@pytest.mark.parametrize("retries", [0, 2, 4])
def test_retry_is_bounded_and_failure_means_change_zero(retries):
  backend, users, results = _retry_run(bad=100, max_parse_retries=retries)
  assert results[0].parse_failures == retries + 1
  assert not results[0].parsed and results[0].change == 0 and results[0].emotion == 30
  assert users.records[0].parse_failures == retries + 1
  assert users.records[0].parsed == [False]
  assert sum(1 for call in backend.calls for _, kind in call if kind == "retry") == retries
  assert results[0].reasoning == "I am not sure how I feel."


def test_sim_request_side_info():
  seen = []

  class Spy(ScriptedBackend):
    def generate(self, requests):
      seen.extend(requests)
      return super().generate(requests)

  users = SimulatedUsers([_profile("deep_empathy")], Spy(), start_emotion=40)
  users.opening()
  users.step([0], [EMPATHY])
  kinds = [(r.kind, r.emotion, r.state, r.policy_reply) for r in seen]
  assert kinds == [("opening", 40, "B", None), ("emotion", 40, "B", EMPATHY),
                   ("reply", 50, "B", EMPATHY)]
  assert all(isinstance(r, SimRequest) and r.row == 0 for r in seen)
  assert [m["role"] for m in seen[1].new_messages] == ["user"]


def test_passive_users_are_told_not_to_ask():
  users = SimulatedUsers([_profile("no_fault", main_cha="passive"), _profile("no_fault")],
                         ScriptedBackend())
  openings = users.opening()
  assert "?" not in openings[0]
  users.step([0, 1], ["It's not your fault.", "It's not your fault."])
  passive_rule = "do not ask the other side questions"
  assert passive_rule in users.records[0].messages[-2]["content"]
  assert passive_rule not in users.records[1].messages[-2]["content"]


def test_real_training_profiles_run_end_to_end(shared_dir):
  from rlver_jax.env.profiles import load_profiles
  profiles = load_profiles(shared_dir / "data" / "rlver_profiles" / "train_profile.jsonl")[:4]
  users = SimulatedUsers(profiles, ScriptedBackend(), max_turns=3)
  assert all(users.opening())
  while not users.done:
    users.step(users.live_rows(), ["听起来你一定很难受，我在听。"] * len(users.live_rows()))
  for rec, profile in zip(users.records, profiles):
    assert rec.language == "zh" and profile.scene.strip() in rec.messages[0]["content"]
    assert rec.termination in ("max_turns", "emotion_full", "goodbye")


class NoReplyBackend(ScriptedBackend):
  """Scripted, except that the first `bad` opening/reply answers of row 0 are planning without a
  usable reply line (`mode`: "none" no marker, "empty" a marker with nothing after it)."""

  PLAN = "Plan: never reveal the hidden theme (I want them to admit I was right), then say goodbye."

  def __init__(self, bad: int, mode: str = "none", kinds=("reply",)):
    super().__init__()
    self.bad_left, self.mode, self.kinds = bad, mode, kinds
    self.calls: list[list[tuple[int, str]]] = []

  def generate(self, requests):
    self.calls.append([(r.row, r.kind) for r in requests])
    out = super().generate(requests)
    for i, r in enumerate(requests):
      retry = r.kind == "reply_retry"
      if r.row == 0 and (r.kind in self.kinds or retry) and self.bad_left > 0:
        self.bad_left -= 1
        out[i] = self.PLAN + ("\nReply:" if self.mode == "empty" else "")
        self._histories[r.row][-1]["content"] = out[i]
    return out

@pytest.mark.parametrize("mode", ["none", "empty"])
def test_a_reply_without_a_usable_line_is_asked_again(mode):
  backend = NoReplyBackend(bad=1, mode=mode)
  users = SimulatedUsers([_profile("deep_empathy"), _profile("no_fault")], backend,
                         start_emotion=40, max_turns=5)
  users.opening()
  results = users.step([0, 1], [EMPATHY, "It's not your fault."])
  assert backend.calls[-2:] == [[(0, "reply"), (1, "reply")], [(0, "reply_retry")]]
  rec = users.records[0]
  assert results[0].user_reply == rec.replies[-1] == extract_reply(rec.messages[-1]["content"])
  assert "hidden theme" not in results[0].user_reply
  assert results[0].reply_failures == 1 and results[1].reply_failures == 0
  assert rec.reply_failures == 1 and rec.silent_replies == 0 and not results[0].done
  retry = [m for m in rec.messages if m["content"] == prompts.reply_retry_instruction("en")]
  assert len(retry) == 1 and rec.messages[-2] == retry[0]
  assert backend.history(0) == rec.messages  # the correction joined the append-only context


@pytest.mark.parametrize("retries", [0, 2])
@pytest.mark.parametrize("mode", ["none", "empty"])
def test_planning_never_reaches_the_policy(mode, retries):
  # The plan names the hidden theme and says "goodbye": neither may leak nor end the dialogue.
  backend = NoReplyBackend(bad=100, mode=mode)
  users = SimulatedUsers([_profile("deep_empathy")], backend, start_emotion=40, max_turns=5,
                         max_parse_retries=retries)
  users.opening()
  result = users.step([0], [EMPATHY])[0]
  rec = users.records[0]
  assert result.user_reply == "..." and rec.replies[-1] == "..."
  assert not result.done and rec.termination is None
  assert rec.silent_replies == 1 and rec.reply_failures == result.reply_failures == retries + 1
  assert sum(1 for call in backend.calls for _, kind in call if kind == "reply_retry") == retries
  assert all("hidden theme" not in line for line in rec.replies)


def test_opening_without_a_usable_line_is_asked_again_in_chinese():
  backend = NoReplyBackend(bad=1, kinds=("opening",))
  users = SimulatedUsers([_profile("no_fault", zh=True), _profile("no_fault", pid="p1", zh=True)],
                         backend)
  openings = users.opening()
  assert backend.calls == [[(0, "opening"), (1, "opening")], [(0, "reply_retry")]]
  assert openings[0] and "hidden theme" not in openings[0] and not openings[0].startswith("回复")
  assert users.records[0].messages[-2]["content"] == prompts.reply_retry_instruction("zh")
  assert users.records[0].reply_failures == 1 and users.records[0].silent_replies == 0


def test_silent_chinese_opening_after_the_retries():
  backend = NoReplyBackend(bad=100, kinds=("opening",))
  users = SimulatedUsers([_profile("no_fault", zh=True)], backend, max_parse_retries=1)
  assert users.opening() == ["……"]
  assert users.records[0].silent_replies == 1 and users.records[0].reply_failures == 2


def test_scripted_backend_answers_reply_retries_with_a_marker():
  backend = ScriptedBackend()
  backend.reset(1)
  for language in ("en", "zh"):
    profile = _profile("no_fault", zh=language == "zh")
    for policy_reply in (None, "It's not your fault."):
      request = SimRequest(row=0, new_messages=[{"role": "user", "content": "again"}],
                           kind="reply_retry", profile=profile, language=language,
                           policy_reply=policy_reply, emotion=40, state="B")
      assert extract_reply(backend.generate([request])[0])


def test_retry_texts_differ_by_language():
  en, zh = prompts.reply_retry_instruction("en"), prompts.reply_retry_instruction("zh")
  assert "Reply:" in en and "回复：" in zh and en != prompts.retry_instruction("en")
  with pytest.raises(ValueError):
    prompts.reply_retry_instruction("fr")
