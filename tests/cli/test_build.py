"""The trainer's samplers take their append buckets from the spec, and bad buckets are one clear
ConfigError naming the key; the run spec refuses settings the algorithm would ignore."""
import importlib.util
import math
import pathlib

import jax.numpy as jnp
import pytest

from rlver_jax import build
from rlver_jax.models import load_pretrained
from rlver_jax.models.embedded import embedded_model_dir
from rlver_jax.models.qwen2 import param_specs
from rlver_jax.parallel.sharding import MeshConfig, make_mesh
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
  config.policy.decode_segment, config.policy.window_step = 8, 256
  spec = _spec(config)
  policy = build.policy_sampler(model, chat, spec.policy, mesh=None)
  assert policy.append_buckets == (8, 24, 96)
  assert policy.decode_segment == 8 and policy.decode_windows == (64, 128, 256, 512, 768, 1024)
  backend = build.simulator_backend(spec.simulator, mesh=None, seed=spec.seed)
  assert backend.sampler.append_buckets == (32, 48, config.simulator.max_context)
  assert backend.sampler.decode_segment == config.simulator.decode_segment == 128


@pytest.mark.parametrize("key, bad", [("decode_segment", -1), ("window_step", -3)])
def test_bad_decode_segments_name_the_key(key, bad):
  config = _config()
  config.policy[key] = bad
  with pytest.raises(build.ConfigError, match=rf"config\.policy\.{key}="):
    _spec(config)


def test_an_int8_simulators_layout_counts_its_weights_in_int8_bytes(monkeypatch):
  """'auto' adds FSDP only when the weight shard would crowd the chip: int8 weights take half the
  bytes, so a chip that needs FSDP 2 for the bf16 simulator holds the int8 one whole."""
  config = _config()
  train = MeshConfig(1, 8, 1)
  model = build.simulator_config(_spec(config).simulator)
  bf16_bytes = 2 * sum(math.prod(p.shape) for p in param_specs(model).values())
  # SmolLM2's 3 kv heads allow no tensor split over 8 devices: the whole model on each chip.
  monkeypatch.setattr(build, "_hbm_bytes", lambda: int(bf16_bytes / 0.35 * 0.75))
  mesh = make_mesh(train)
  layouts = {}
  for weights in ("bf16", "int8"):
    config.simulator.weight_dtype = weights
    config.simulator.dtype = "bfloat16"
    layouts[weights] = build.simulator_mesh(_spec(config).simulator, train, mesh)[1]
  assert layouts == {"bf16": "data=4 fsdp=2 tensor=1 (auto)", "int8": "data=8 fsdp=1 tensor=1 (auto)"}


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
  # off-policy; a rollout correction (rl.is_correction) is what makes them usable.
  for algo in ("grpo_think", "ppo_nothink"):
    config = _config(algo, None)
    config.policy[key] = value
    with pytest.raises(build.ConfigError, match=r"config\.policy sampling .*config\.rl\.is_correction"):
      _spec(config)
    config.rl.is_correction = "token_tis"
    _spec(config)
    config.rl.is_correction = "geo_mask"  # as does any correction
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
