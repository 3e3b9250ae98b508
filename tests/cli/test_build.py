"""The trainer's samplers take their append buckets from the spec, and bad buckets are one clear
ConfigError naming the key; the run spec refuses settings the algorithm would ignore."""
import importlib.util
import pathlib

import jax.numpy as jnp
import pytest

from rlver_jax import build
from rlver_jax.models import load_pretrained
from rlver_jax.models.embedded import embedded_model_dir
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.spec import EvaluationSpec, RunSpec

REPO = pathlib.Path(__file__).resolve().parents[2]


def _config(name="grpo_think", arg="runlocal"):
  spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _spec(config):
  return (RunSpec if "algo" in config else EvaluationSpec).from_config(config)


@pytest.mark.parametrize("name", ["grpo_think", "ppo_nothink", "eval_sentient"])
def test_shipped_configs_declare_valid_buckets(name):
  config = _config(name, None)
  spec = _spec(config)
  for role in ("policy", "simulator"):
    assert getattr(spec, role).append_buckets == tuple(config[role].append_buckets)


@pytest.mark.parametrize("bad", [(), (64, 16), (16, 16, 64), (0, 16), (16.5, 64)])
def test_bad_buckets_name_the_key(bad):
  config = _config()
  config.simulator.append_buckets = bad
  with pytest.raises(build.ConfigError, match=r"config\.simulator\.append_buckets="):
    _spec(config)


def test_samplers_use_the_configured_buckets():
  config = _config()
  config.policy.append_buckets = (8, 24, 96)
  config.simulator.append_buckets = (32, 48, 4096)  # past max_context: collapses into it
  path = embedded_model_dir()
  model, _ = load_pretrained(path, dtype=jnp.float32)
  chat = ChatTokens(load_tokenizer(path))
  spec = _spec(config)
  assert build.policy_sampler(model, chat, spec.policy, mesh=None).append_buckets == (8, 24, 96)
  backend = build.simulator_backend(spec.simulator, mesh=None, seed=spec.seed)
  assert backend.sampler.append_buckets == (32, 48, config.simulator.max_context)


def test_contexts_past_the_checkpoints_trained_length_are_refused(monkeypatch):
  config = _config()
  path = embedded_model_dir()
  model, _ = load_pretrained(path, dtype=jnp.float32)
  chat = ChatTokens(load_tokenizer(path))
  trained = model.config.max_position_embeddings  # 8192 for SmolLM2
  config.policy.max_context = trained + 1
  with pytest.raises(build.ConfigError, match=rf"config.policy.max_context={trained + 1} exceeds .*\({trained}\)"):
    build.policy_sampler(model, chat, _spec(config).policy, mesh=None)
  config.simulator.max_context = trained * 2
  # Refused before the simulator's weights load.
  monkeypatch.setattr(build, "load_pretrained", lambda *a, **k: pytest.fail("loaded the simulator"))
  with pytest.raises(build.ConfigError, match="config.simulator.max_context"):
    build.simulator_backend(_spec(config).simulator, mesh=None, seed=0)


@pytest.mark.parametrize("overrides,key", [
    (dict(reward_mode="per_turn"), "config.rl.reward_mode"),
    (dict(kl_in_reward=True, kl_coef=0.1), "config.rl.kl_in_reward"),
    (dict(loss_norm_len=-1), "config.rl.loss_norm_len"),
    (dict(group_size=1), "config.rl.group_size"),
])
def test_grpo_refuses_settings_it_would_ignore(overrides, key):
  config = _config()
  for k, v in overrides.items():
    config.rl[k] = v
  with pytest.raises(build.ConfigError, match=key.replace(".", r"\.")):
    _spec(config)


def test_ppo_takes_per_turn_rewards_and_kl_in_reward():
  config = _config("ppo_nothink", None)
  config.rl.reward_mode, config.rl.kl_in_reward, config.rl.kl_coef = "per_turn", True, 0.1
  assert _spec(config).loss_config().kl_coef == 0.0  # the KL moved into the rewards


@pytest.mark.parametrize("key,value", [("temperature", 0.7), ("top_p", 0.9), ("top_k", 20)])
def test_reshaped_policy_sampling_needs_importance_correction(key, value):
  # Ratios are taken against the model's T=1 log-probs, so tempered / truncated samples are
  # off-policy; a rollout correction (rl.is_correction, formerly rl.tis_cap) is what makes them usable.
  for algo in ("grpo_think", "ppo_nothink"):
    config = _config(algo, None)
    config.policy[key] = value
    with pytest.raises(build.ConfigError, match=r"config\.policy sampling .*config\.rl\.is_correction"
                                                r".*config\.rl\.tis_cap"):
      _spec(config)
    config.rl.tis_cap = 2.0  # the older spelling still works
    _spec(config)
    config.rl.tis_cap, config.rl.is_correction = 0.0, "geo_mask"  # as does any correction
    _spec(config)


def test_unknown_algo_is_a_config_error():
  config = _config()
  config.algo = "dpo"
  with pytest.raises(build.ConfigError, match=r"config\.algo"):
    _spec(config)


def test_dr_grpo_divisor_is_a_run_constant():
  # seq-mean-token-sum-norm divides by a fixed length; it used to be each batch's packed length.
  config = _config()
  assert _spec(config).loss_config().norm_len == config.policy.max_context
  config.rl.loss_norm_len = 4096
  assert _spec(config).loss_config().norm_len == 4096


def test_holdout_evaluation_samples_like_the_sentient_evaluation():
  # eval/score during training must be comparable with `rlver_jax.evaluate` (configs/eval_sentient.py).
  train_cfg, eval_cfg = _config("grpo_think", None), _config("eval_sentient", None)
  holdout, final = _spec(train_cfg).holdout_rollout_config(), _spec(eval_cfg).rollout_config()
  assert (holdout.temperature, holdout.top_p, holdout.top_k) == (final.temperature, final.top_p, final.top_k)
  assert holdout.reward_mode == "terminal" and not holdout.format_penalty
  rollout = _spec(train_cfg).rollout_config()
  assert (rollout.temperature, rollout.top_p, rollout.top_k) == (1.0, 1.0, 0)  # training is unchanged


def test_input_paths_name_what_every_host_must_see():
  config = _config("grpo_nothink")
  assert build.input_paths(_spec(config)) == {}  # the embedded model and demo profiles ship in packages
  config.data.profiles, config.policy.checkpoint = "/data/p.jsonl", "gs://b/policy"
  config.simulator.backend, config.simulator.checkpoint = "model", "/models/sim"
  assert build.input_paths(_spec(config)) == {"data.profiles": "/data/p.jsonl",
                                              "policy.checkpoint": "gs://b/policy",
                                              "simulator.checkpoint": "/models/sim"}
  config.algo, config.critic.checkpoint = "ppo", "/models/critic"
  assert build.input_paths(_spec(config))["critic.checkpoint"] == "/models/critic"
  evaluation = EvaluationSpec(policy=_spec(config).policy, simulator=_spec(config).simulator,
                              data=_spec(config).data)
  assert build.input_paths(evaluation) == {"data.profiles": "/data/p.jsonl",
                                           "policy.checkpoint": "gs://b/policy",
                                           "simulator.checkpoint": "/models/sim"}
