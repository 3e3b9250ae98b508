"""The run's provenance: prompt texts fingerprinted, a resume with other prompts refused, the code
version recorded at every start."""
import json
import sys

import pytest

from rlver_jax.run import provenance
from rlver_jax.env import simulator_prompts
from rlver_jax.run.saved_config import ConfigConflictError

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "configs"))
import base  # noqa: E402


def _config(think=True):
  return base.get_base_config("grpo", think=think, arg=None)


def test_fingerprint_follows_the_prompt_texts(monkeypatch):
  a = provenance.prompts_sha256(True, "vanilla")
  assert a == provenance.prompts_sha256(True, "vanilla")
  assert a != provenance.prompts_sha256(False, "vanilla")  # the think prompt is another text
  assert a != provenance.prompts_sha256(True, "challenging")
  original = simulator_prompts.retry_instruction
  monkeypatch.setattr(simulator_prompts, "retry_instruction", lambda lang: original(lang) + " ")
  assert provenance.prompts_sha256(True, "vanilla") != a  # a one-character edit is seen


def test_resume_with_other_prompts_is_refused(tmp_path, monkeypatch):
  config = _config()
  first = provenance.check(config, str(tmp_path))
  provenance.append(str(tmp_path), first)
  provenance.append(str(tmp_path), provenance.check(config, str(tmp_path)))  # same prompts: fine
  history = json.loads((tmp_path / "provenance.json").read_text())
  assert len(history) == 2 and history[0]["prompts_sha256"] == first["prompts_sha256"]
  assert history[0]["git_commit"]
  original = simulator_prompts.reply_instruction
  monkeypatch.setattr(simulator_prompts, "reply_instruction", lambda *a: original(*a) + "!")
  with pytest.raises(ConfigConflictError, match="prompt texts changed"):
    provenance.check(config, str(tmp_path))
  assert len(json.loads((tmp_path / "provenance.json").read_text())) == 2  # nothing written


def test_resume_with_other_profile_contents_is_refused(tmp_path):
  from rlver_jax.env.profiles import load_demo_profiles
  config, profiles = _config(), load_demo_profiles()
  provenance.append(str(tmp_path), provenance.check(config, str(tmp_path), profiles))
  provenance.check(config, str(tmp_path), profiles)  # the same contents: fine
  edited = [profiles[0].__class__(**{**profiles[0].__dict__, "scene": "another scene"})] + profiles[1:]
  with pytest.raises(ConfigConflictError, match="training profiles' contents changed"):
    provenance.check(config, str(tmp_path), edited)
  with pytest.raises(ConfigConflictError, match="training profiles' contents changed"):
    provenance.check(config, str(tmp_path), profiles[::-1])  # same profiles, other order
