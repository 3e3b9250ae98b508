"""The floor of a step's decode: what no layout can beat on the slice's memory bandwidth.

Per decode step every weight must be read once somewhere on the slice (the compute-dtype weights
but the token embedding, of which a step reads one row per cache row), and every row its filled cache
(keys and values of every layer up to its length). Spread perfectly over n chips:

  seconds = (steps x weight bytes + filled slot-steps x rows x KV bytes per slot) / (n x HBM bytes/s)

Filled slot-steps come from the stated lengths (`step_calls`: `ROLE/decode_slots`); a recorded step
has none, and the window each step attended stands in for them (an upper bound, said so).
"""
from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from rlver_jax.aot import programs as ap
from rlver_jax.aot.chips import ChipSpec
from rlver_jax.spec.forward import ModelShape
from rlver_jax.spec import RunSpec


@dataclasses.dataclass(frozen=True)
class Floor:
  role: str
  steps: float          # decode steps (one token per row each)
  weight_bytes: float   # read per step
  kv_bytes: float       # all steps' filled cache, all rows
  seconds: float
  from_windows: bool    # slot-steps not known: the attended windows stood in
  slot_steps: float = 0.0   # filled slots summed over steps, one row


def decode_weight_bytes(model: ModelShape) -> int:
  """Compute-dtype bytes a decode step must read: every weight but the token embedding's table."""
  model = dataclasses.replace(model, param_dtype=model.dtype)
  _, state = nnx.split(ap._module(model))
  flat = nnx.to_flat_state(state)
  return sum(math.prod(v.shape) * v.dtype.itemsize for path, v in flat
             if not (path[0] == "embed" and not ap.model_config(model).tie_word_embeddings))


def kv_bytes_per_slot(model: ModelShape) -> int:
  """One row's keys and values of one cache slot, every layer, in the cache's dtype (an int8 cache
  adds its fp32 scale per token and KV head)."""
  c = ap.model_config(model)
  dtype = jax.numpy.dtype(ap.cache_dtype(model))
  scale = 4 if dtype == jax.numpy.int8 else 0
  return 2 * c.num_layers * c.num_kv_heads * (c.head_dim * dtype.itemsize + scale)


def decode_floor(spec: RunSpec, calls: dict[str, float], role: str,
                 devices: int, chip: ChipSpec) -> Floor | None:
  """The floor of `role`'s decode steps in `calls` on `devices` chips; None without decode steps."""
  decode = {int(k.rpartition("/W")[2]): n for k, n in calls.items()
            if k.startswith(f"{role}/decode_steps/W")}
  steps = sum(decode.values())
  if not steps:
    return None
  model = ap.policy_model(spec) if role == "policy" else ap.simulator_model(spec)
  slots = calls.get(f"{role}/decode_slots")
  from_windows = slots is None
  if from_windows:
    slots = sum(w * n for w, n in decode.items())
  weights = decode_weight_bytes(model)
  kv = slots * ap.lent_rows(spec) * kv_bytes_per_slot(model)
  return Floor(role, steps, weights, kv, (steps * weights + kv) / (devices * chip.bytes_per_s),
               from_windows, slots)


@dataclasses.dataclass(frozen=True)
class Split:
  """Where a decode step's estimated bytes go, per device: `fixed` whatever the window (weights,
  sampling), `per_slot` for each slot of the attended window, and `kv_per_slot`: the keys and values
  of one slot of every row that the device holds (its share of the cache)."""
  fixed: float
  per_slot: float
  kv_per_slot: float
  weight_shard: float = 0.0   # the decode weights one device holds (a cross-check of `fixed`)

  def in_place_seconds(self, f: Floor, chip: ChipSpec) -> float:
    """The decode's memory time if each step read the filled slots once (no window rounding, no
    copies of the window) and the fixed bytes as now."""
    return (f.steps * self.fixed + f.slot_steps * self.kv_per_slot) / chip.bytes_per_s


def format_floors(floors: list[Floor], decode_seconds: dict[str, tuple[float, float]],
                  devices: int, splits: dict[str, Split] | None = None,
                  chip: ChipSpec | None = None) -> str:
  """One line per role: the floor, its parts, and the estimate's ratio to it (roofline, link);
  with `splits`, where the estimate's bytes go and what reading the filled cache in place gives."""
  lines = []
  for f in floors:
    roof, linked = decode_seconds[f.role]
    note = " (slots: attended windows, an upper bound)" if f.from_windows else ""
    lines.append(
        f"floor, {f.role} decode: {f.seconds:.3f} s (a bound) = ({f.steps:,.0f} steps x "
        f"{f.weight_bytes / 1e9:.2f} GB weights + {f.kv_bytes / 1e9:,.1f} GB filled KV{note}) over "
        f"{devices} chips' HBM; roofline / floor = {roof / f.seconds:.2f}, "
        f"{linked / f.seconds:.2f} (with link time)")
    s = (splits or {}).get(f.role)
    if s and chip:
      lines.append(
          f"  per device and step: {s.fixed / 1e9:.2f} GB whatever the window (its weight shard: "
          f"{s.weight_shard / 1e9:.2f} GB) + "
          f"{s.per_slot / 1e3:,.1f} kB per window slot, {s.per_slot / s.kv_per_slot:.2f}x the "
          f"{s.kv_per_slot / 1e3:,.1f} kB of k and v a slot holds on a device; reading only the "
          f"filled slots once: {s.in_place_seconds(f, chip):.3f} s")
  return "\n".join(lines)
