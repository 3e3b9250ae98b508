"""Nominal peak FLOP/s and memory bandwidth per chip, for the step-time model's roofline.

Figures are the vendors' published peaks, per chip (one JAX device: a v4/v5p chip's two TensorCores
are one megacore device), dense bf16:
  TPU v5p  459 TFLOP/s, 2,765 GB/s HBM2e   cloud.google.com/tpu/docs/v5p
  TPU v5e  197 TFLOP/s,   819 GB/s HBM2    cloud.google.com/tpu/docs/v5e
  TPU v4   275 TFLOP/s, 1,200 GB/s HBM2    cloud.google.com/tpu/docs/v4
  TPU v6e  918 TFLOP/s, 1,640 GB/s HBM     cloud.google.com/tpu/docs/v6e
  H100 SXM 989 TFLOP/s, 3.35 TB/s HBM3     NVIDIA H100 Tensor Core GPU datasheet (dense, no sparsity)
  H200 SXM 989 TFLOP/s, 4.8 TB/s HBM3e     NVIDIA H200 Tensor Core GPU datasheet (dense, no sparsity)
Interconnect per chip (all links, the same pages): v5p 4,800 Gbps, v5e 1,600 Gbps, v4 2,400 Gbps,
v6e 3,584 Gbps (ICI); H100 / H200 900 GB/s (NVLink 4).
Latency per ring step of a collective: 1 us on every TPU family, an assumption: the ICI link latency
ASTRA-sim models TPUs with ("1 us, as per TPU research team", astra-sim.github.io, validation on
TPU-v3), unmeasured here; a small all-reduce over 8 devices then takes 14 us. GPUs: none known (0).
Real programs reach a fraction of these; the model says so in its assumptions.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ChipSpec:
  name: str
  flops_per_s: float       # peak dense FLOP/s in the compute dtype (bf16)
  bytes_per_s: float       # peak memory (HBM) bandwidth
  link_bytes_per_s: float = 0.0  # interconnect bandwidth per chip, all links (0: unknown)
  hop_latency_s: float = 0.0     # latency of one ring step of a collective (0: unknown)

  def __post_init__(self):
    if not (self.flops_per_s > 0 and self.bytes_per_s > 0):
      raise ValueError(f"chip {self.name!r}: peak FLOP/s and bandwidth must be > 0, got "
                       f"{self.flops_per_s:g} and {self.bytes_per_s:g}")


_ICI_HOP_S = 1e-6

CHIPS: dict[str, ChipSpec] = {
    "v5p": ChipSpec("TPU v5p", 459e12, 2765e9, 4800e9 / 8, _ICI_HOP_S),
    "v5e": ChipSpec("TPU v5e", 197e12, 819e9, 1600e9 / 8, _ICI_HOP_S),
    "v4": ChipSpec("TPU v4", 275e12, 1200e9, 2400e9 / 8, _ICI_HOP_S),
    "v6e": ChipSpec("TPU v6e", 918e12, 1640e9, 3584e9 / 8, _ICI_HOP_S),
    "h100": ChipSpec("NVIDIA H100 SXM", 989e12, 3.35e12, 900e9),
    "h200": ChipSpec("NVIDIA H200 SXM", 989e12, 4.8e12, 900e9),
}

# `device.device_kind` as libtpu reports it (see aot.topology.CHIP_HBM) -> CHIPS key.
_KINDS = {"TPU v5": "v5p", "TPU v5p": "v5p", "TPU v5 lite": "v5e", "TPU v4": "v4",
          "TPU v6 lite": "v6e", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200"}


def chip_for_kind(kind: str) -> ChipSpec:
  """The spec of a device kind (`jax.Device.device_kind`); ValueError naming it if unknown."""
  key = _KINDS.get(kind, kind.lower())
  if key not in CHIPS:
    raise ValueError(f"no peak FLOP/s or bandwidth known for device kind {kind!r}; known: "
                     f"{', '.join(CHIPS)} (or give --chip_flops and --chip_bandwidth)")
  return CHIPS[key]
