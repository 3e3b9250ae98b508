"""An aot config (configs/aot_forward.py) as typed settings: the models the ahead-of-time programs
build (`ModelShape`) and one model's full-sequence forward at a batch and length (`ForwardSpec`)."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from rlver_jax.parallel.sharding import MeshConfig
from rlver_jax.spec.sections import ConfigError, require


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
  def from_config(cls, config: Mapping) -> "ForwardSpec":
    tree = config.to_dict() if hasattr(config, "to_dict") else dict(config)  # a ConfigDict, or data
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
