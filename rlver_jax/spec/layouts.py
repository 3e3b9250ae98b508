"""Each model's layout: the training mesh, or a serving mesh over the same devices.

`config.mesh` is the training layout (policy, critic, optimizer: FSDP by default). Decode is
memory-bound: a step reads every weight of a chip's shard once. Under FSDP a chip all-gathers and reads
the whole model per token; tensor parallelism over heads and the MLP reads 1/tensor of it, and the
remaining chips split the cache rows (data). `simulator.mesh` and `rollout.policy_mesh` pick the layout
of each decoding model:

  'train'            config.mesh, as before (for comparison)
  'auto'             `auto_layout`: tensor parallel as wide as the heads allow, data over the rest
  'DATAxFSDPxTENSOR' explicit sizes, e.g. '4x1x8' (one entry may be -1: the remaining devices)

A serving layout whose tensor size does not divide the model's head counts is refused (the rules would
otherwise replicate those weights on every chip without a word).

`decode_mesh` is the one resolver the trainer (`build.decode_mesh`) and the step-time and memory
model (`aot.layouts.resolve`) both call: the same weight bytes (`weight_bytes`), the same sizes, the
same device order.
"""
from __future__ import annotations

import math

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlver_jax.models.presets import Qwen2Config
from rlver_jax.parallel.sharding import MESH_AXES, MeshConfig
from rlver_jax.spec.sections import ConfigError, check_layout

TRAIN, AUTO = "train", "auto"
LAYOUT_KEYS = ("simulator.mesh", "rollout.policy_mesh")
# A weight shard at most this share of a chip's memory leaves room for the KV cache (and, for the
# policy, the training state that stays resident beside its decode copy).
WEIGHT_SHARE_OF_HBM = 0.35


def check_layout_value(value, key: str) -> None:
  """ConfigError unless `value` is 'train', 'auto' or 'DATAxFSDPxTENSOR'."""
  check_layout(key, value)


def parse_explicit(value: str) -> MeshConfig:
  data, fsdp, tensor = (int(s) for s in value.split("x"))
  return MeshConfig(data=data, fsdp=fsdp, tensor=tensor)


def _divides_heads(model: Qwen2Config, tensor: int) -> bool:
  return not (model.num_heads % tensor or model.num_kv_heads % tensor
              or model.intermediate_size % tensor)


def auto_layout(model: Qwen2Config, num_devices: int, *, weight_bytes: int | None = None,
                hbm_bytes: int | None = None) -> MeshConfig:
  """The serving layout 'auto' picks: the widest tensor size that divides the device count and the
  model's q heads, kv heads and MLP width (so never wider than the kv heads: each chip keeps whole kv
  heads of the cache); the other devices split the cache rows. When the chip's memory is known and the
  weight shard would take more than WEIGHT_SHARE_OF_HBM of it, the smallest FSDP size that brings it
  under is added (weights then all-gathered per step, over that many chips only)."""
  tensor = max(t for t in range(1, num_devices + 1)
               if num_devices % t == 0 and _divides_heads(model, t))
  fsdp = 1
  if weight_bytes and hbm_bytes:
    rest = num_devices // tensor
    for f in range(1, rest + 1):
      fsdp = f
      if rest % f == 0 and weight_bytes / (tensor * f) <= WEIGHT_SHARE_OF_HBM * hbm_bytes:
        break
  return MeshConfig(data=num_devices // (tensor * fsdp), fsdp=fsdp, tensor=tensor)


def resolve_layout(value: str, key: str, model: Qwen2Config, train: MeshConfig, num_devices: int,
                   *, weight_bytes: int | None = None, hbm_bytes: int | None = None
                   ) -> MeshConfig:
  """The resolved mesh sizes (no -1) a decoding model gets from its layout setting `value`."""
  check_layout_value(value, key)
  try:
    if value == TRAIN:
      return MeshConfig(*train.resolve(num_devices))
    if value == AUTO:
      return auto_layout(model, num_devices, weight_bytes=weight_bytes, hbm_bytes=hbm_bytes)
    sizes = parse_explicit(value).resolve(num_devices)
  except ValueError as e:
    raise ConfigError(f"config.{key}={value!r}: {e}") from e
  if not _divides_heads(model, sizes[2]):
    raise ConfigError(
        f"config.{key}={value!r}: tensor={sizes[2]} does not divide the model's "
        f"{model.num_heads} q heads, {model.num_kv_heads} kv heads and MLP width "
        f"{model.intermediate_size}; use a divisor of {math.gcd(model.num_kv_heads, num_devices)} "
        "or 'auto'")
  return MeshConfig(*sizes)


def describe(mesh: MeshConfig) -> str:
  """'data=4 fsdp=1 tensor=8' for logs and the saved config."""
  return f"data={mesh.data} fsdp={mesh.fsdp} tensor={mesh.tensor}"


def weight_bytes(model: Qwen2Config, dtype, *, int8_weights: bool = False) -> int:
  """Bytes of a decoding model's weights as it stores them, every shard together (int8 weights
  with their scales): what 'auto' weighs against the chip's memory."""
  from rlver_jax.models.factory import abstract_model  # pylint: disable=import-outside-toplevel
  _, state = nnx.split(abstract_model(model, param_dtype=dtype, dtype=dtype,
                                      int8_weights=int8_weights))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in nnx.to_flat_state(state).leaves)


def decode_mesh(value: str, key: str, model: Qwen2Config, train: MeshConfig, train_mesh: Mesh, *,
                weight_bytes: int | None = None, hbm_bytes: int | None = None) -> Mesh:
  """The mesh a decoding model gets from its setting `value` at config `key`: `resolve_layout`'s
  sizes over the training mesh's devices in the training mesh's order (the training mesh itself
  when the sizes are equal). One order for both: a jit between the two meshes (the reshard of the
  policy's decode copy) refuses meshes that order the same devices differently."""
  sizes = resolve_layout(value, key, model, train, train_mesh.size, weight_bytes=weight_bytes,
                         hbm_bytes=hbm_bytes)
  shape = (sizes.data, sizes.fsdp, sizes.tensor)
  if shape == tuple(train_mesh.shape[a] for a in MESH_AXES):
    return train_mesh
  return Mesh(np.asarray(train_mesh.devices).reshape(shape), MESH_AXES)


def mesh_sizes(mesh: Mesh) -> MeshConfig:
  return MeshConfig(*(mesh.shape[a] for a in MESH_AXES))
