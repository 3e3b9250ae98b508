"""The decode layouts each model may get (rlver_jax/spec/layouts.py)."""
import pytest

from rlver_jax.models.presets import get_preset
from rlver_jax.spec.layouts import auto_layout, check_layout_value, resolve_layout
from rlver_jax.parallel.sharding import MeshConfig
from rlver_jax.spec import ConfigError, RunSpec

FSDP_ALL = MeshConfig(data=1, fsdp=-1, tensor=1)


@pytest.mark.parametrize("preset, devices, expected", [
    ("qwen2.5-72b", 32, (4, 1, 8)),   # 8 kv heads: tensor 8, the rest split the rows
    ("qwen2.5-7b", 32, (8, 1, 4)),    # 4 kv heads (28 q): never wider than 4
    ("qwen2.5-7b", 2, (1, 1, 2)),
    ("qwen2.5-0.5b", 8, (4, 1, 2)),   # 14 q / 2 kv heads
    ("qwen2.5-14b", 12, (3, 1, 4)),   # 8 kv heads but 12 devices: the widest common divisor
])
def test_auto_is_the_widest_tensor_size_the_heads_and_devices_allow(preset, devices, expected):
  m = auto_layout(get_preset(preset), devices)
  assert (m.data, m.fsdp, m.tensor) == expected


def test_auto_adds_fsdp_only_when_the_weight_shard_would_not_leave_room():
  model, gib = get_preset("qwen2.5-72b"), 2**30
  weights = 145 * gib
  roomy = auto_layout(model, 32, weight_bytes=weights, hbm_bytes=95 * gib)   # v5p: 18 GiB shard
  tight = auto_layout(model, 32, weight_bytes=weights, hbm_bytes=16 * gib)   # v5e: needs fsdp 4
  assert (roomy.data, roomy.fsdp, roomy.tensor) == (4, 1, 8)
  assert (tight.data, tight.fsdp, tight.tensor) == (1, 4, 8)
  assert weights / (tight.tensor * tight.fsdp) <= 0.35 * 16 * gib < weights / (8 * 2)


def test_train_and_explicit_layouts_resolve_over_the_same_devices():
  model = get_preset("qwen2.5-7b")
  train = resolve_layout("train", "simulator.mesh", model, FSDP_ALL, 32)
  assert (train.data, train.fsdp, train.tensor) == (1, 32, 1)
  explicit = resolve_layout("-1x1x4", "simulator.mesh", model, FSDP_ALL, 32)
  assert (explicit.data, explicit.fsdp, explicit.tensor) == (8, 1, 4)


def test_a_tensor_size_that_does_not_divide_the_heads_is_refused_naming_the_key():
  with pytest.raises(ConfigError, match=r"config\.rollout\.policy_mesh='4x1x8'.*4 kv heads"):
    resolve_layout("4x1x8", "rollout.policy_mesh", get_preset("qwen2.5-7b"), FSDP_ALL, 32)
  with pytest.raises(ConfigError, match=r"config\.simulator\.mesh='2x2x2'.*8 devices, but 32"):
    resolve_layout("2x2x2", "simulator.mesh", get_preset("qwen2.5-7b"), FSDP_ALL, 32)


@pytest.mark.parametrize("value", ["tp8", "4x8", "0x1x8", "-1x-1x8", 8, ""])
def test_malformed_layout_values_are_one_line_config_errors(value):
  with pytest.raises(ConfigError, match=r"config\.simulator\.mesh="):
    check_layout_value(value, "simulator.mesh")
  with pytest.raises(ConfigError, match=r"config\.rollout\.policy_mesh="):
    RunSpec.from_config({"rollout": {"policy_mesh": value}})
