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
