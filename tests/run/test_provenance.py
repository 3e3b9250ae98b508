"""The run's provenance: prompt texts fingerprinted, a resume with other prompts refused, the code
version recorded at every start."""
import json
import sys

import pytest

from rlver_jax.run import provenance
from rlver_jax.env import simulator_prompts
from rlver_jax.run.saved_config import ConfigConflictError
from rlver_jax.spec import RunSpec

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "configs"))
import base  # noqa: E402


def _config(think=True):
  return RunSpec.from_config(base.get_base_config("grpo", think=think, arg=None))


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


def test_each_hub_checkpoint_is_recorded_with_its_commit(tmp_path, monkeypatch, caplog):
  import dataclasses
  import hub_cache
  from rlver_jax.models.io import hub
  model = tmp_path / "model"  # what resolving looks at: a snapshot with safetensors weights
  model.mkdir()
  (model / "config.json").write_text("{}")
  (model / "model.safetensors").write_bytes(b"")
  cache, first, second = tmp_path / "cache", hub_cache.commit_hash("a"), hub_cache.commit_hash("b")
  hub_cache.add_snapshot(cache, "org/policy", model, first)
  hub_cache.add_snapshot(cache, "org/sim", model, second)
  hub_cache.use_cache(monkeypatch, cache)
  monkeypatch.setattr(hub, "_resolved", {})
  spec = _config()
  spec = dataclasses.replace(
      spec, policy=dataclasses.replace(spec.policy, checkpoint="org/policy"),
      simulator=dataclasses.replace(spec.simulator, backend="model", checkpoint=f"org/sim@{second}"))
  workdir = str(tmp_path / "run")
  provenance.append(workdir, provenance.check(spec, workdir))
  start, = json.loads((tmp_path / "run" / "provenance.json").read_text())
  assert start["hub_checkpoints"] == {
      "policy.checkpoint": {"id": "org/policy", "commit": first},
      "simulator.checkpoint": {"id": f"org/sim@{second}", "commit": second}}
  assert "hub_checkpoints" not in provenance.describe(_config())  # local and embedded: nothing
  # The branch moved before a resume: recorded again, and said.
  hub_cache.add_snapshot(cache, "org/policy", model, second)
  monkeypatch.setattr(hub, "_resolved", {})
  now = provenance.check(spec, workdir)
  assert now["hub_checkpoints"]["policy.checkpoint"]["commit"] == second
  assert f"config.policy.checkpoint=org/policy is commit {second} now, {first} when" in caplog.text
