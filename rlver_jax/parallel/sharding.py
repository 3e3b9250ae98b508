"""Device mesh and the one logical-axis -> mesh-axis rules object.

Model, sampler and trainer code name array dimensions with logical axes ("batch", "embed", "q_heads",
...). `ShardingRules` is the only place that maps those names to the mesh axes ("data", "fsdp",
"tensor"), so switching between FSDP and tensor parallelism is a change here, nowhere else.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh shape; one entry may be -1 to take all remaining devices."""
  data: int = 1
  fsdp: int = -1
  tensor: int = 1

  def resolve(self, num_devices: int) -> tuple[int, int, int]:
    sizes = [self.data, self.fsdp, self.tensor]
    if sizes.count(-1) > 1:
      raise ValueError(f"mesh: at most one axis may be -1, got {self}")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes) or num_devices % known:
      raise ValueError(f"mesh {self} does not divide the {num_devices} available devices")
    sizes = [num_devices // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != num_devices:
      raise ValueError(
          f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} = {math.prod(sizes)} devices, "
          f"but {num_devices} are available")
    return tuple(sizes)


def make_mesh(config: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh over `devices` (default: all devices of all processes)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = config.resolve(len(devices))
  try:  # TPU: an order that keeps each mesh axis on neighbouring chips of the ICI torus
    device_array = mesh_utils.create_device_mesh(shape, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):  # a topology it has no rule for
    device_array = np.asarray(devices).reshape(shape)
  return Mesh(device_array, MESH_AXES)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Maps logical axis names to mesh axes. Unknown names are replicated."""
  rules: tuple[tuple[str, MeshAxes], ...]

  def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
    """The mesh axes a logical axis maps to, in order; () when it is replicated."""
    axes = dict(self.rules).get(logical) if logical else None
    return (axes,) if isinstance(axes, str) else tuple(axes or ())

  def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None,
           mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes.

    With `shape` and `mesh`, a mesh axis is dropped from a dimension it does not divide (e.g. 2 KV heads
    on a 4-way tensor axis are replicated instead), so every preset fits every mesh; `dropped` says
    which.
    """
    return self._assign(logical_axes, shape, mesh)[0]

  def dropped(self, logical_axes: Sequence[str | None], shape: Sequence[int],
              mesh: Mesh) -> list[tuple[str, int, str]]:
    """(logical axis, its size, mesh axis) for each mesh axis `spec` leaves out because it does not
    divide the dimension: that dimension is replicated over the axis instead of split."""
    return self._assign(logical_axes, shape, mesh)[1]

  def _assign(self, logical_axes, shape, mesh) -> tuple[PartitionSpec, list[tuple[str, int, str]]]:
    used: set[str] = set()
    out, dropped = [], []
    for i, name in enumerate(logical_axes):
      kept = []
      for ax in self.mesh_axes(name):
        if ax in used:
          continue
        if mesh is not None and shape is not None:
          size = math.prod(mesh.shape[a] for a in kept + [ax])
          if shape[i] % size:
            if mesh.shape[ax] > 1:
              dropped.append((name, shape[i], ax))
            continue
        kept.append(ax)
      used.update(kept)
      out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*out), dropped

  def sharding(self, mesh: Mesh, logical_axes: Sequence[str | None],
               shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, self.spec(logical_axes, shape, mesh))


# Params: FSDP over the embedding dimension, tensor parallel over heads / MLP / vocabulary.
# Activations: batch over data x fsdp, heads over tensor.
DEFAULT_RULES = ShardingRules((
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # Replicated: "layers", "head_dim", "norm", "seq", "cache_seq", "act_embed".
))


def batch_shards(mesh: Mesh, rules: ShardingRules | None = None) -> int:
  """How many ways the "batch" logical axis is split on `mesh` (data x fsdp by default)."""
  return math.prod(mesh.shape[a] for a in (rules or DEFAULT_RULES).mesh_axes("batch"))


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def padded_batch(rows: int, mesh: Mesh | None) -> int:
  """`rows` rounded up to a multiple of the batch shards. A batch they do not divide is sharded
  over fewer devices or replicated (a 72B simulator's 16k-slot cache of 20 rows on 32 chips: the
  whole 100 GiB on every chip), so rollout caches are padded with inactive rows to this."""
  return rows if mesh is None else round_up(rows, batch_shards(mesh))


def constrain(x: jax.Array, logical_axes: Sequence[str | None],
              rules: ShardingRules = DEFAULT_RULES) -> jax.Array:
  """Sharding constraint on an activation; a no-op outside a mesh context (plain single-device use)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, rules.spec(logical_axes, x.shape, mesh))


def host_array(x) -> np.ndarray:
  """The full value of a (possibly multi-host sharded) array on every host, as numpy."""
  if isinstance(x, np.ndarray) or getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def global_array(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A sharded array from a host value every process holds in full (each puts only its shards)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def broadcast_bytes(data: bytes | None) -> bytes:
  """Process 0's `data` on every process (the others pass None); a no-op with one process."""
  if jax.process_count() == 1:
    return data or b""
  from jax.experimental import multihost_utils
  mine = np.frombuffer(data or b"", np.uint8) if jax.process_index() == 0 else None
  n = int(multihost_utils.broadcast_one_to_all(np.int32(0 if mine is None else mine.size)))
  # Same shape on every process, at least one element; process 0's bytes win.
  buf = np.zeros(max(n, 1), np.uint8)
  if mine is not None:
    buf[:n] = mine
  return np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes()[:n]
