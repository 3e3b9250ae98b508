"""What `python -m rlver_jax.aot` compiles, as typed settings: the one aot module that reads a ConfigDict.

A config file is either a training config (configs/grpo_think.py, ...), read into the run's own
`RunSpec` so that the tool plans exactly the run the trainer would start, or an aot config naming
its programs (configs/aot_forward.py), read into `ForwardSpec`. Everything else in `rlver_jax.aot`
takes one of the two (`Target`) and the models they describe as `ModelShape`.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Union

import ml_collections

from rlver_jax.parallel.sharding import MeshConfig
from rlver_jax.spec import ConfigError, RunSpec, require


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """A model as the aot programs build it: its architecture (`preset`, "NAME:L" for L layers, or
  `num_layers`), dtypes, remat, append buckets, and the simulator's int8 settings."""
  preset: str
  param_dtype: str = "bfloat16"
  dtype: str = "bfloat16"
  remat: str = "none"
  append_buckets: tuple[int, ...] = ()   # () = the sampler's defaults
  weight_dtype: str = "bf16"
  kv_dtype: str = "bf16"
  num_layers: int | None = None


@dataclasses.dataclass(frozen=True)
class ForwardSpec:
  """configs/aot_forward.py: one model's full-sequence forward at a batch and length."""
  model: ModelShape
  mesh: MeshConfig = MeshConfig()
  batch_size: int = 8
  seq_len: int = 2048
  programs: tuple[str, ...] = ("forward",)

  def __post_init__(self):
    for key in ("batch_size", "seq_len"):
      value = getattr(self, key)
      require(f"forward.{key}", value, isinstance(value, int) and value >= 1, "an integer >= 1")
    layers = self.model.num_layers
    require("model.num_layers", layers, layers is None or (isinstance(layers, int) and layers >= 1),
            "None (the preset's depth) or an integer >= 1")

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict | Mapping) -> "ForwardSpec":
    tree = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
    known = {"programs", "model", "mesh", "forward"}
    unknown = sorted(set(tree) - known)
    if unknown:
      raise ConfigError(f"config.{unknown[0]}: not a key of an aot config (known: {sorted(known)})")
    try:
      model = ModelShape(**tree["model"])
      mesh = MeshConfig(**tree.get("mesh", {}))
      forward = tree.get("forward", {})
      return cls(model, mesh, programs=tuple(tree["programs"]), **forward)
    except TypeError as e:  # an unknown key inside a section
      raise ConfigError(f"aot config: {e}") from None


Target = Union[RunSpec, ForwardSpec]


def from_config(config: ml_collections.ConfigDict | Mapping) -> Target:
  """The typed target of a config file: an aot config names its `programs`; any other is a training
  config. ConfigError (a ValueError) names the first bad key."""
  if "programs" in config:
    return ForwardSpec.from_config(config)
  return RunSpec.from_config(config)


def is_run(target: Target) -> bool:
  return isinstance(target, RunSpec)


def with_policy(spec: RunSpec, **changes) -> RunSpec:
  return dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, **changes))


def with_rollout_rows(spec: RunSpec, rows: int) -> RunSpec:
  """`spec` with `rollout.rows` set, checked as the config value would be."""
  return dataclasses.replace(spec, rollout=dataclasses.replace(spec.rollout, rows=rows))
