"""The reference's and the benchmark's dialogue rules as config values: turn budget, the two
termination thresholds, the change clamp, numeric scoring guidance, the evaluation's policy prompt,
each against a hand-built case, and their wiring from the configs into training and evaluation."""
import dataclasses
from types import SimpleNamespace

import pytest

from rlver_jax.spec import EvaluationSpec, RunSpec
from rlver_jax.train import holdout as holdout_module
from rlver_jax.train import trainer as trainer_module
from rlver_jax.train.trainer import Trainer
from rlver_jax.env import simulator_prompts as prompts
from rlver_jax.env.backends import HistoryBackend
from rlver_jax.env.chat import policy_system_prompt
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.env.parsing import parse_change
from rlver_jax.env.simulator import SimulatedUsers

from config_files import load_config as _config


class _Fixed(HistoryBackend):
  """States the same change every emotion step; replies 'okay' (never a goodbye)."""

  def __init__(self, change: str):
    super().__init__()
    self.change = change

  def generate(self, requests):
    self._extend(requests)
    out = [f"Change: {self.change}" if r.kind in ("emotion", "retry") else "Reply: okay"
           for r in requests]
    for r, text in zip(requests, out):
      self._answer(r.row, text)
    return out


def _play(change: str, **kw):
  users = SimulatedUsers(load_demo_profiles()[:1], _Fixed(change), start_emotion=30, **kw)
  users.opening()
  while not users.done:
    users.step([0], ["I hear you."])
  return users.records[0]


def test_turn_budget_counts_policy_replies():
  rec = _play("+0", max_turns=9)
  assert rec.turns == 9 and rec.termination == "max_turns" and len(rec.emotions) == 10
  # The reference's limit 8, checked after the user's reply, allows 9 replies: the default.
  assert _config("grpo_think").simulator.max_turns == 9
  assert _config("ppo_nothink").simulator.max_turns == 9
  assert _config("eval_sentient").eval.max_turns == 9


@pytest.mark.parametrize("end_below,turns,termination", [(1, 5, "emotion_zero"),
                                                         (10, 3, "emotion_low")])
def test_termination_threshold(end_below, turns, termination):
  # 30 -> 23 -> 16 -> 9 -> 2 -> 0: the benchmark stops at 9 (< 10), training at 0.
  rec = _play("-7", max_turns=9, end_below=end_below)
  assert rec.turns == turns and rec.termination == termination
  assert rec.emotions == [30, 23, 16, 9, 2, 0][:turns + 1]
  assert len(rec.replies) == turns + 1  # the state-F user still says their last line


def test_threshold_defaults_training_vs_evaluation():
  grpo = _config("grpo_think")
  assert grpo.simulator.end_below == 1 and grpo.eval.end_below == 10
  assert _config("eval_sentient").eval.end_below == 10
  assert EvaluationSpec.from_config(_config("eval_sentient")).eval.end_below == 10


@pytest.mark.parametrize("clamp,stated,emotions", [(True, "+25", [30, 40, 50]),
                                                   (False, "+25", [30, 55, 80]),
                                                   (False, "+45", [30, 75, 100])])
def test_change_clamp(clamp, stated, emotions):
  rec = _play(stated, max_turns=2, clamp_change=clamp)
  assert rec.emotions == emotions  # unclamped, the emotion is still capped at 100


def test_parse_change_without_clamp():
  assert parse_change("Change: -40") == -10
  assert parse_change("Change: -40", clamp=False) == -40
  assert parse_change("变化：+13", clamp=False) == 13
  assert parse_change("Change: none", clamp=False) == 0


@pytest.mark.parametrize("language", ["en", "zh"])
@pytest.mark.parametrize("style", ["vanilla", "challenging"])
def test_numeric_guidance_is_an_option(language, style):
  plain = prompts.emotion_instruction("hi", 30, language, style)
  guided = prompts.emotion_instruction("hi", 30, language, style, guidance=True)
  assert guided.startswith(plain.rstrip(".。")[:-20]) and len(guided) > len(plain)
  if style == "vanilla":
    assert "+3" in guided and "+3" not in plain.replace("+3\"", "").replace("+3”", "")
  # The simulator sends the guided text only when asked to.
  for flag in (False, True):
    backend = _Fixed("+1")
    users = SimulatedUsers(load_demo_profiles()[:1], backend, style=style, language_override=language,
                           max_turns=1, score_guidance=flag)
    users.opening()
    users.step([0], ["hi"])
    sent = [m["content"] for m in backend.history(0) if m["role"] == "user"][1]
    assert sent == prompts.emotion_instruction("hi", 30, language, style, guidance=flag)


def test_guidance_is_off_in_the_shipped_configs():
  assert _config("grpo_think").simulator.score_guidance is False
  assert _config("eval_sentient").simulator.score_guidance is False


def test_evaluation_policy_prompt():
  for language in ("en", "zh"):
    partner = policy_system_prompt(True, language, "chat_partner")
    assert partner == policy_system_prompt(False, language, "chat_partner")
    assert partner != policy_system_prompt(True, language)
    assert "<think>" not in partner
    sage = policy_system_prompt(True, language, "sage")
    assert sage == policy_system_prompt(False, language, "sage") and sage != partner
    assert "<think>" not in sage
  assert "emotional intelligence" in policy_system_prompt(False, "en", "sage")
  assert "情商" in policy_system_prompt(False, "zh", "sage")
  with pytest.raises(ValueError, match="unknown policy system prompt"):
    policy_system_prompt(True, "en", "benchmark")
  grpo = _config("grpo_think")
  assert RunSpec.from_config(grpo).rollout_config().system_prompt == "training"
  assert RunSpec.from_config(grpo).holdout_rollout_config().system_prompt == "sage"
  ev = _config("eval_sentient")
  assert EvaluationSpec.from_config(ev).rollout_config().system_prompt == "sage"
  ev.eval.policy_prompt = "chat_partner"
  assert EvaluationSpec.from_config(ev).rollout_config().system_prompt == "chat_partner"
  ev.eval.policy_prompt = "training"
  assert EvaluationSpec.from_config(ev).rollout_config().system_prompt == "training"


class _Stop(Exception):
  pass


def _capture(monkeypatch):
  def playing(profiles, backend, rules, groups=None):  # the real constructor's checks ran in UserRules
    raise _Stop({**dataclasses.asdict(rules), "groups": groups})
  fake = SimpleNamespace(playing=playing)
  monkeypatch.setattr(trainer_module, "SimulatedUsers", fake)
  monkeypatch.setattr(holdout_module, "SimulatedUsers", fake)


def test_trainer_and_holdout_pass_their_rules(monkeypatch):
  import jax
  _capture(monkeypatch)
  c = _config("grpo_think")
  profiles = load_demo_profiles()[:2]
  trainer = SimpleNamespace(spec=RunSpec.from_config(c), backend=HistoryBackend(), holdout=profiles,
                            profile_sampler=SimpleNamespace(next_batch=lambda n: profiles[:n]))
  with pytest.raises(_Stop) as training:
    Trainer.rollout(trainer, jax.random.key(0))
  kw = training.value.args[0]
  assert (kw["max_turns"], kw["end_below"], kw["clamp_change"], kw["score_guidance"]) == (9, 1, True,
                                                                                          False)
  assert list(kw["groups"]) == [0, 0, 0, 0, 1, 1, 1, 1]  # two profiles x group_size 4
  with pytest.raises(_Stop) as holdout:
    holdout_module.evaluate_holdout(trainer.spec, trainer, None, trainer.holdout, jax.random.key(0))
  kw = holdout.value.args[0]
  assert (kw["max_turns"], kw["end_below"], kw["start_emotion"]) == (9, 10, 40)
  assert kw["info_flow"] == "sage"  # eval.info_flow, not training's simulator.info_flow
  c.unlock()
  c.rl.shared_opening = False
  c.simulator.clamp_change, c.simulator.change_mode, c.simulator.style = False, "expected", "challenging"
  trainer.spec = RunSpec.from_config(c)
  with pytest.raises(_Stop) as unshared:
    Trainer.rollout(trainer, jax.random.key(0))
  kw = unshared.value.args[0]
  assert kw["groups"] is None
  assert (kw["clamp_change"], kw["change_mode"], kw["style"]) == (False, "expected", "challenging")
  with pytest.raises(_Stop) as holdout:  # config.eval's change rules, training's style
    holdout_module.evaluate_holdout(trainer.spec, trainer, None, trainer.holdout, jax.random.key(0))
  kw = holdout.value.args[0]
  assert (kw["clamp_change"], kw["change_mode"], kw["style"]) == (True, "sampled", "challenging")
  assert (kw["change_range"], kw["goodbye_match"]) == (10, "clause")
  # :reference: SAGE's rules in the held-out evaluation while training reads the change unclamped.
  trainer.spec = RunSpec.from_config(_config("grpo_think", "reference"))
  with pytest.raises(_Stop) as holdout:
    holdout_module.evaluate_holdout(trainer.spec, trainer, None, trainer.holdout, jax.random.key(0))
  kw = holdout.value.args[0]
  assert trainer.spec.simulator.clamp_change is False
  assert (kw["clamp_change"], kw["change_range"], kw["goodbye_match"]) == (True, 0, "substring")


def test_sentient_users_take_the_eval_game_and_the_simulator_rules():
  ev = _config("eval_sentient")
  # SAGE's change and goodbye rules by default: clamped in code, no range stated, any 再见 / 拜拜.
  rules = EvaluationSpec.from_config(ev).simulator.user_rules(EvaluationSpec.from_config(ev).eval)
  assert (rules.clamp_change, rules.change_range, rules.goodbye_match) == (True, 0, "substring")
  ev.simulator.style, ev.simulator.max_parse_retries = "challenging", 1
  ev.eval.start_emotion, ev.eval.max_turns, ev.eval.end_below = 55, 4, 20
  ev.eval.clamp_change, ev.eval.state_change_range, ev.eval.goodbye_match = False, 10, "clause"
  spec = EvaluationSpec.from_config(ev)  # its simulator section keeps training's game defaults
  assert (spec.simulator.start_emotion, spec.simulator.max_turns, spec.simulator.end_below) == (30, 9, 1)
  assert (spec.simulator.clamp_change, spec.simulator.goodbye_match) == (True, "clause")
  rules = spec.simulator.user_rules(spec.eval)
  assert (rules.start_emotion, rules.max_turns, rules.end_below) == (55, 4, 20)
  assert (rules.clamp_change, rules.change_range, rules.goodbye_match) == (False, 10, "clause")
  assert (rules.style, rules.max_parse_retries) == ("challenging", 1)
  users = SimulatedUsers.playing(load_demo_profiles()[:2], HistoryBackend(), rules)
  assert [r.emotion for r in users.records] == [55, 55] and users.rules == rules
