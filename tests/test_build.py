"""The trainer's samplers take their append buckets from the config, and bad buckets are one clear
ConfigError naming the key."""
import importlib.util
import pathlib

import jax.numpy as jnp
import pytest

from rlver_jax import build
from rlver_jax.models import load_pretrained
from rlver_jax.models.embedded import embedded_model_dir
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]


def _config(name="grpo_think", arg="runlocal"):
  spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.mark.parametrize("name", ["grpo_think", "ppo_nothink", "eval_sentient"])
def test_shipped_configs_declare_valid_buckets(name):
  config = _config(name, None)
  for role in ("policy", "simulator"):
    assert build.append_buckets(config, role) == tuple(config[role].append_buckets)


@pytest.mark.parametrize("bad", [(), (64, 16), (16, 16, 64), (0, 16), (16.5, 64)])
def test_bad_buckets_name_the_key(bad):
  config = _config()
  config.simulator.append_buckets = bad
  with pytest.raises(build.ConfigError, match=r"config\.simulator\.append_buckets="):
    build.append_buckets(config, "simulator")


def test_samplers_use_the_configured_buckets():
  config = _config()
  config.policy.append_buckets = (8, 24, 96)
  config.simulator.append_buckets = (32, 48, 4096)  # past max_context: collapses into it
  path = embedded_model_dir()
  model, _ = load_pretrained(path, dtype=jnp.float32)
  chat = ChatTokens(load_tokenizer(path))
  assert build.policy_sampler(model, chat, config, mesh=None).append_buckets == (8, 24, 96)
  backend = build.simulator_backend(config, mesh=None)
  assert backend.sampler.append_buckets == (32, 48, config.simulator.max_context)


def test_contexts_past_the_checkpoints_trained_length_are_refused(monkeypatch):
  config = _config()
  path = embedded_model_dir()
  model, _ = load_pretrained(path, dtype=jnp.float32)
  chat = ChatTokens(load_tokenizer(path))
  trained = model.config.max_position_embeddings  # 8192 for SmolLM2
  config.policy.max_context = trained + 1
  with pytest.raises(build.ConfigError, match=rf"config.policy.max_context={trained + 1} exceeds .*\({trained}\)"):
    build.policy_sampler(model, chat, config, mesh=None)
  config.simulator.max_context = trained * 2
  # Refused before the simulator's weights load.
  monkeypatch.setattr(build, "load_pretrained", lambda *a, **k: pytest.fail("loaded the simulator"))
  with pytest.raises(build.ConfigError, match="config.simulator.max_context"):
    build.simulator_backend(config, mesh=None)


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
    build.check_algo(config)


def test_ppo_takes_per_turn_rewards_and_kl_in_reward():
  config = _config("ppo_nothink", None)
  config.rl.reward_mode, config.rl.kl_in_reward, config.rl.kl_coef = "per_turn", True, 0.1
  build.check_algo(config)
  assert build.loss_config(config).kl_coef == 0.0  # the KL moved into the rewards


@pytest.mark.parametrize("key,value", [("temperature", 0.7), ("top_p", 0.9), ("top_k", 20)])
def test_reshaped_policy_sampling_needs_importance_correction(key, value):
  # Ratios are taken against the model's T=1 log-probs, so tempered / truncated samples are
  # off-policy; truncated importance sampling (rl.tis_cap) is what makes them usable.
  for algo in ("grpo_think", "ppo_nothink"):
    config = _config(algo, None)
    config.policy[key] = value
    with pytest.raises(build.ConfigError, match=r"config\.policy sampling .*config\.rl\.tis_cap"):
      build.check_algo(config)
    config.rl.tis_cap = 2.0
    build.check_algo(config)


def test_unknown_algo_is_a_config_error():
  config = _config()
  config.algo = "dpo"
  with pytest.raises(build.ConfigError, match=r"config\.algo"):
    build.check_algo(config)


def test_dr_grpo_divisor_is_a_run_constant():
  # seq-mean-token-sum-norm divides by a fixed length; it used to be each batch's packed length.
  config = _config()
  assert build.loss_config(config).norm_len == config.policy.max_context
  config.rl.loss_norm_len = 4096
  assert build.loss_config(config).norm_len == 4096


def test_holdout_evaluation_samples_like_the_sentient_evaluation():
  # eval/score during training must be comparable with `rlver_jax.evaluate` (configs/eval_sentient.py).
  train_cfg, eval_cfg = _config("grpo_think", None), _config("eval_sentient", None)
  holdout, final = build.holdout_rollout_config(train_cfg), build.rollout_config(eval_cfg, eval_mode=True)
  assert (holdout.temperature, holdout.top_p, holdout.top_k) == (final.temperature, final.top_p, final.top_k)
  assert holdout.reward_mode == "terminal" and not holdout.format_penalty
  rollout = build.rollout_config(train_cfg)
  assert (rollout.temperature, rollout.top_p, rollout.top_k) == (1.0, 1.0, 0)  # training is unchanged


def test_input_paths_name_what_every_host_must_see():
  config = _config("grpo_nothink")
  assert build.input_paths(config) == {}  # the embedded model and the demo profiles ship in packages
  config.data.profiles, config.policy.checkpoint = "/data/p.jsonl", "gs://b/policy"
  config.simulator.backend, config.simulator.checkpoint = "model", "/models/sim"
  assert build.input_paths(config) == {"data.profiles": "/data/p.jsonl",
                                       "policy.checkpoint": "gs://b/policy",
                                       "simulator.checkpoint": "/models/sim"}
  config.algo, config.critic.checkpoint = "ppo", "/models/critic"
  assert build.input_paths(config)["critic.checkpoint"] == "/models/critic"
  assert "critic.checkpoint" not in build.input_paths(config, training=False)
