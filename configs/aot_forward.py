"""Ahead-of-time memory report of the model forward pass on a TPU topology, compiled on a CPU machine.

  python -m rlver_jax.aot --config=configs/aot_forward.py:qwen2.5-72b --topology=v5p:2x2x2
  python -m rlver_jax.aot --config=configs/aot_forward.py --find_smallest

The argument is a model preset ("qwen2.5-7b" by default, "qwen2.5-72b", ...) or "tiny": 7B widths with
2 layers and a short batch, for tests. Override anything with flags, e.g. `--config.forward.seq_len=4096`
or `--config.model.num_layers=4` (any preset with fewer layers).
"""
import ml_collections
from ml_collections import config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = arg or "qwen2.5-7b"
  tiny = arg == "tiny"
  c = ml_collections.ConfigDict()
  c.programs = ("forward",)

  c.model = ml_collections.ConfigDict()
  c.model.preset = "qwen2.5-7b" if tiny else arg
  # None keeps the preset's depth; an int builds the same widths with that many layers.
  c.model.num_layers = 2 if tiny else config_dict.placeholder(int)
  c.model.param_dtype = "bfloat16"
  c.model.dtype = "bfloat16"
  c.model.remat = "none"  # "none" | "full" | "dots"; matters only where gradients are taken

  # One entry may be -1 (the remaining devices); a mesh that does not fit the topology falls back to
  # fsdp over all devices.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1

  c.forward = ml_collections.ConfigDict()
  c.forward.batch_size = 8
  c.forward.seq_len = 128 if tiny else 2048

  c.lock()
  return c
