"""Tests for the policy prompts, policy-output parsing and goodbye detection."""
from __future__ import annotations

import pytest

from rlver_jax.env import chat


# --- System prompts -----------------------------------------------------------------------------

@pytest.mark.parametrize("language", ["en", "zh"])
def test_prompts(language):
  think = chat.policy_system_prompt(True, language)
  plain = chat.policy_system_prompt(False, language)
  assert "<think>" in think and "</think>" in think
  assert "<think>" not in plain
  assert think != plain


def test_prompt_unknown_language():
  with pytest.raises(ValueError):
    chat.policy_system_prompt(True, "fr")


# --- Parsing ------------------------------------------------------------------------------------

def test_think_well_formed():
  t = chat.parse_policy_output("  <think>She sounds tired.</think>\nThat sounds exhausting.", True)
  assert t == chat.PolicyTurn("She sounds tired.", "That sounds exhausting.", True)


def test_think_with_stop_marker():
  t = chat.parse_policy_output("<think>a</think>Hi there<|im_end|>\n<|im_start|>user", True)
  assert t.reply == "Hi there" and t.format_ok


def test_think_multiple_blocks_uses_last():
  text = "<think>one</think>draft<think>two</think> final reply"
  t = chat.parse_policy_output(text, True)
  assert t.thought == "two" and t.reply == "final reply"
  assert not t.format_ok


def test_think_missing_close_tag():
  text = "<think>I should be kind and"
  t = chat.parse_policy_output(text, True)
  assert t.thought is None
  assert t.reply == text  # No </think>: the whole text is what the user sees.
  assert not t.format_ok


def test_think_missing_open_tag():
  t = chat.parse_policy_output("some thought</think>Hello", True)
  assert t.thought is None and t.reply == "Hello" and not t.format_ok


def test_think_not_at_start():
  t = chat.parse_policy_output("Sure. <think>x</think> Hello", True)
  assert t.reply == "Hello" and t.thought == "x" and not t.format_ok


@pytest.mark.parametrize("text", ["<think>plan</think>", "<think>plan</think>   \n",
                                  "<think>plan</think>Assistant:  "])
def test_think_empty_reply(text):
  t = chat.parse_policy_output(text, True)
  assert t.reply == "" and not t.format_ok


def test_think_empty_thought():
  t = chat.parse_policy_output("<think> \n</think>Hello", True)
  assert t.thought == "" and t.reply == "Hello" and not t.format_ok


@pytest.mark.parametrize("raw,reply", [
    ("Assistant: hi", "hi"),
    ("assistant：你好", "你好"),
    ("AI: hello", "hello"),
    ("Me:  sure thing", "sure thing"),
    ("我：好的呀", "好的呀"),
    ("助手:嗯嗯", "嗯嗯"),
    ("**Assistant:** hey", "hey"),
    ("I said: hello", "I said: hello"),  # Not a label.
    ("Aim: to help", "Aim: to help"),
    ("hi Assistant: there", "hi Assistant: there"),  # Only at the very start.
    ("Assistant: Assistant: x", "Assistant: x"),  # Only one label.
])
def test_speaker_label_removed(raw, reply):
  assert chat.parse_policy_output(raw, False).reply == reply
  assert chat.parse_policy_output(f"<think>t</think>{raw}", True).reply == reply


def test_no_think_mode():
  assert chat.parse_policy_output("  Oh no, that's rough. ", False) == chat.PolicyTurn(
      None, "Oh no, that's rough.", True)
  t = chat.parse_policy_output("<think>x</think>Hello", False)
  assert t.reply == "Hello" and t.thought == "x" and not t.format_ok
  assert not chat.parse_policy_output("Hello <think>", False).format_ok
  assert not chat.parse_policy_output("   ", False).format_ok
  assert not chat.parse_policy_output("<|im_end|>", False).format_ok


def test_strip_stop():
  assert chat.strip_stop("hello<|im_end|>") == "hello"
  assert chat.strip_stop("hello<|endoftext|>") == "hello"
  assert chat.strip_stop("a<|endoftext|>b<|im_end|>c") == "a"
  assert chat.strip_stop("plain") == "plain"


# --- Goodbye detection --------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "好的，谢谢你，再见！", "拜拜啦", "那我先走了，拜拜~", "好的bye", "嗯嗯，bye bye",
    "好的，再见！", "再见了", "拜拜~", "那就这样吧，再见", "再见啦😊", "下次再见。", "拜拜咯～谢谢你",
    "谢谢，再见了。", "那就再见吧", "再见啦朋友", "再见了朋友们", "拜拜了您嘞",
])
def test_goodbye_zh(text):
  assert chat.says_goodbye(text, "zh")


@pytest.mark.parametrize("text", ["我还想再聊聊", "你说得对，我再想想", "再次见到他时我很紧张",
                                  "我真的不想再见到他了", "我们再见面的时候再说吧", "我没再见过她",
                                  "我真的不想再见他了", "以后还能再见吗", "以后还能再见？",
                                  "我再也不想再见了", "我没来得及跟她说再见。", "我不想和你说再见",
                                  "再见到你真好", "再见了吗？", "还能再见你吗", "我想再见你一面"])
def test_not_goodbye_zh(text):
  assert not chat.says_goodbye(text, "zh")


@pytest.mark.parametrize("text", [
    "Thanks, goodbye.", "OK. Bye!", "bye", "BYE-BYE", "Good-bye then", "Good bye, friend.",
    "Alright, see you later.", "See you!", "see ya tomorrow", "Farewell.",
    "I have to go now, take care!", "Talk to you later.", "ok talk soon 🙂",
    "Thanks for listening. Goodbye Sam", "You helped, bye now",
    "See you again soon!", "Thanks. See you again.", "I'll see you later!",
    "I have to talk to you later.", "Got to see you tomorrow, bye",
])
def test_goodbye_en(text):
  assert chat.says_goodbye(text, "en")


@pytest.mark.parametrize("text", [
    "He was just a bystander.", "The byes in the tournament were unfair.", "Maybe later.",
    "I never got to say goodbye to her.", "We said goodbye at the station and I cried.",
    "They threw me a farewell party.", "I hate goodbyes.", "I see you're busy.",
    "I see you care about this.", "Please take care of the forms.", "Let's talk later about it",
    "Buy it by Monday.", "Standby mode.", "It was a goodbye gift.",
    "I never want to see you again.", "I don't want to see you again!", "I won't see you again.",
    "Will I ever see you again?", "Nice to see you.",
])
def test_not_goodbye_en(text):
  assert not chat.says_goodbye(text, "en")


def test_english_does_not_match_chinese_words():
  assert not chat.says_goodbye("再见", "en")


def test_goodbye_unknown_language():
  with pytest.raises(ValueError):
    chat.says_goodbye("bye", "de")


@pytest.mark.parametrize("raw,think,label,reference", [
    # Think mode: the reference keeps what follows the last 你：/你: of the visible text.
    ("<think>plan</think>你：别急，慢慢说", True, "你：别急，慢慢说", "别急，慢慢说"),
    ("<think>plan</think>我：嗯。你:先休息一下吧", True, "嗯。你:先休息一下吧", "先休息一下吧"),
    ("<think>plan</think>Assistant: take your time", True, "take your time",
     "Assistant: take your time"),
    # No-think: the reference passes the text as it is; "label" drops a leading speaker label.
    ("回复：你：我在听", False, "你：我在听", "回复：你：我在听"),
    ("Assistant: I'm here", False, "I'm here", "Assistant: I'm here"),
])
def test_reply_cut(raw, think, label, reference):
  assert chat.parse_policy_output(raw, think).reply == label
  assert chat.parse_policy_output(raw, think, "label").reply == label
  assert chat.parse_policy_output(raw, think, "reference").reply == reference


def test_reply_cut_unknown():
  with pytest.raises(ValueError, match="reply cut"):
    chat.parse_policy_output("hi", False, "both")
