"""The reference mechanics of docs/REPRODUCING.md about prompts and evaluation, each with its key:
the training system prompt (`policy.prompt`), the evaluation's cap per policy turn
(`eval.policy_max_new_tokens`) and the simulator's information flow in evaluation
(`eval.info_flow`). Each test tells the two values of its key apart."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from rlver_jax.env.backends import HistoryBackend, ScriptedBackend
from rlver_jax.env.chat import policy_system_prompt
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.env.rollout import run_dialogues
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.models.embedded import embedded_model_dir
from rlver_jax.models.factory import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.spec import ConfigError, EvaluationSpec, RunSpec

from config_files import load_config as _config


@pytest.fixture(scope="module")
def tiny():
  """A 1-layer random model over SmolLM2's vocabulary: it rarely samples a stop id, so a turn runs
  to its cap."""
  chat = ChatTokens(load_tokenizer(embedded_model_dir()))
  cfg = Qwen2Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=16, tie_word_embeddings=True, qkv_bias=False)
  model = create_model(cfg, dtype=jnp.float32, seed=3, init_std=0.5)
  sampler = Sampler(model, max_len=1024, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                    append_buckets=(64, 512))
  return chat, model, sampler


def _first_turn(tiny, cfg):
  """One dialogue of one policy turn under `cfg`: (its sample's text, the turn's sampled count)."""
  chat, model, sampler = tiny
  profiles = load_demo_profiles()[:1]
  users = SimulatedUsers(profiles, ScriptedBackend(), start_emotion=30, max_turns=1)
  [d] = run_dialogues(profiles, [0], users, sampler=sampler, params=nnx.state(model), chat=chat,
                      cfg=cfg, rng=jax.random.key(0))
  sample = d.samples[0]
  return chat.tokenizer.decode(sample.tokens), sum(sample.loss_mask)


# -- policy.prompt --------------------------------------------------------------------------------


@pytest.mark.parametrize("think", [True, False])
@pytest.mark.parametrize("language", ["en", "zh"])
def test_the_two_training_prompts_differ_in_their_ask(think, language):
  own = policy_system_prompt(think, language)
  released = policy_system_prompt(think, language, training="reference")
  assert own != released
  # The released prompts' meaning: a friend, emotionally intelligent replies.
  assert ("friend" in released and "emotionally intelligent" in released) if language == "en" \
      else ("朋友" in released and "高情商" in released)
  assert ("<think>" in released) == think and ("<think>" in own) == think
  with pytest.raises(ValueError, match="unknown training prompt"):
    policy_system_prompt(think, language, training="released")


def test_the_training_rollout_opens_with_the_configured_prompt(tiny):
  for arg, kind in ((None, "project"), ("reference", "reference")):
    spec = RunSpec.from_config(_config("grpo_think", arg))
    assert spec.policy.prompt == kind
    cfg = spec.rollout_config()
    cfg = dataclasses.replace(cfg, max_new_tokens=4, language="en")
    text, _ = _first_turn(tiny, cfg)
    assert policy_system_prompt(True, "en", training=kind) in text
    other = "reference" if kind == "project" else "project"
    assert policy_system_prompt(True, "en", training=other) not in text
  # eval.policy_prompt="training" in evaluation is the configured training prompt too.
  ev = _config("eval_sentient")
  ev.eval.policy_prompt, ev.policy.prompt = "training", "reference"
  assert EvaluationSpec.from_config(ev).rollout_config().training_prompt == "reference"
  c = _config("grpo_think")
  c.policy.prompt = "released"
  with pytest.raises(ConfigError, match=r"config.policy.prompt='released': must be one of"):
    RunSpec.from_config(c)


# -- eval.policy_max_new_tokens -------------------------------------------------------------------


def test_the_evaluation_cap_per_policy_turn(tiny):
  c = _config("grpo_think", "runlocal")
  spec = RunSpec.from_config(c)
  assert spec.holdout_rollout_config().max_new_tokens == 32  # 0: the training cap
  c.eval.policy_max_new_tokens, c.policy.max_new_tokens = 7, 5
  spec = RunSpec.from_config(c)
  assert (spec.rollout_config().max_new_tokens, spec.holdout_rollout_config().max_new_tokens) == (5, 7)
  _, sampled = _first_turn(tiny, spec.holdout_rollout_config())
  assert sampled == 7  # the random model never stops on its own: the turn ran to its cap
  _, sampled = _first_turn(tiny, spec.rollout_config())
  assert sampled == 5
  assert RunSpec.from_config(_config("grpo_think", "reference")).holdout_rollout_config(
  ).max_new_tokens == 5000
  ev = _config("eval_sentient")
  assert EvaluationSpec.from_config(ev).rollout_config().max_new_tokens == 5000
  ev.eval.policy_max_new_tokens = 0  # no training cap to fall back on
  with pytest.raises(ConfigError, match=r"config.eval.policy_max_new_tokens=0: must be >= 1"):
    EvaluationSpec.from_config(ev)
  c.eval.policy_max_new_tokens = -1
  with pytest.raises(ConfigError, match=r"config.eval.policy_max_new_tokens=-1"):
    RunSpec.from_config(c)


# -- eval.info_flow -------------------------------------------------------------------------------


class _Analyst(HistoryBackend):
  """Writes every analysis section (each with its own word), then a plain reply line."""

  def __init__(self):
    super().__init__()
    self.reply_requests = []

  def generate(self, requests):
    self._extend(requests)
    out = []
    for r in requests:
      if r.kind == "reply":
        self.reply_requests.append(r.new_messages[-1]["content"])
      if r.kind in ("emotion", "retry"):
        text = ("Meaning: m-word\nFit with my hidden theme: fit-word\nInner reaction: "
                "reaction-word\nFeeling: feeling-word\nChange: +2")
      else:
        text = "Reply: fine."
      out.append(text)
      self._answer(r.row, text)
    return out


def _reply_request(info_flow):
  backend = _Analyst()
  users = SimulatedUsers(load_demo_profiles()[:1], backend, start_emotion=40, max_turns=2,
                         info_flow=info_flow)
  users.opening()
  users.step([0], ["I hear you."])
  [request] = backend.reply_requests
  return request


def test_the_sage_flow_shows_the_reply_step_the_inner_reaction_too():
  reference, sage = _reply_request("reference"), _reply_request("sage")
  for text in (reference, sage):
    assert "fit-word" in text and "feeling-word" in text and "m-word" not in text
    assert "+2" not in text and "42" not in text  # never the change or the emotion
  assert "reaction-word" in sage and "reaction-word" not in reference


def test_evaluations_take_eval_info_flow():
  for arg in (None, "reference"):
    spec = RunSpec.from_config(_config("grpo_think", arg))
    assert spec.simulator.user_rules(spec.eval).info_flow == "sage"  # the held-out evaluation
  assert spec.simulator.user_rules().info_flow == "reference"  # training keeps its own
  ev = _config("eval_sentient")
  spec = EvaluationSpec.from_config(ev)
  assert spec.simulator.user_rules(spec.eval).info_flow == "sage"
  ev.eval.info_flow = "reference"
  spec = EvaluationSpec.from_config(ev)
  assert spec.simulator.user_rules(spec.eval).info_flow == "reference"
  ev.eval.info_flow = "benchmark"
  with pytest.raises(ConfigError, match=r"config.eval.info_flow='benchmark': must be one of"):
    EvaluationSpec.from_config(ev)
