"""TPU slices described by libtpu without a TPU: compile-only devices and their HBM.

May import: jax and libtpu (found at run time). Everything else in aot/ reads slices from here.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Sequence

import jax
from jax.experimental import topologies

_GIB = 2**30
_INSTALL = 'pip install "jax[tpu]==0.12.0.1"'

# HBM per chip, keyed by `device.device_kind` as libtpu reports it.
CHIP_HBM: dict[str, int] = {
    "TPU v4": 32 * _GIB,
    "TPU v5 lite": 16 * _GIB,  # v5e (v5litepod)
    "TPU v5": 95 * _GIB,       # v5p
    "TPU v5p": 95 * _GIB,
    "TPU v6 lite": 32 * _GIB,  # v6e (Trillium)
}

# Slices in increasing size per chip family, all accepted by libtpu's topology API.
CANDIDATES: dict[str, tuple[str, ...]] = {
    "v5e": ("v5e:1x1", "v5e:2x2", "v5e:2x4", "v5e:4x4", "v5e:4x8", "v5e:8x8", "v5e:8x16",
            "v5e:16x16"),
    "v5p": ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4", "v5p:4x4x8",
            "v5p:4x8x8", "v5p:8x8x8", "v5p:8x8x16", "v5p:8x16x16"),
    "v6e": ("v6e:1x1", "v6e:2x2", "v6e:2x4", "v6e:4x4", "v6e:4x8", "v6e:8x8", "v6e:8x16",
            "v6e:16x16"),
}


class AotError(Exception):
  """A user-facing error: printed as one line, exit status 1."""


@contextlib.contextmanager
def _quiet_libtpu_init():
  """Off a TPU VM libtpu cannot discover its host and logs warnings; these values only describe this
  (compile-only) process while libtpu starts, every topology is given explicitly. They are removed
  afterwards: child processes (a training run) must not take this machine for a TPU VM."""
  on_tpu = os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio")
  values = {} if on_tpu else {
      "TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost",
      # No TPU to share: let several compile-only processes (a report and a test run) load libtpu.
      "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
  added = [k for k in values if k not in os.environ]
  os.environ.update({k: values[k] for k in added})
  try:
    yield
  finally:
    for k in added:
      os.environ.pop(k, None)


def _require_libtpu() -> None:
  try:
    import libtpu  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    if not os.environ.get("TPU_LIBRARY_PATH"):
      raise AotError(f"libtpu is not installed; compiling for TPU needs it: {_INSTALL}") from None


def _chip_dims(name: str) -> tuple[int, ...]:
  _, _, dims = name.partition(":")
  try:
    return tuple(int(d) for d in dims.split("x"))
  except ValueError:
    raise AotError(f"invalid TPU topology {name!r}: expected e.g. v5e:2x2, v5p:2x2x2, v6e:4x4") from None


def get_topology(name: str) -> list[jax.Device]:
  """Compile-only devices of a TPU slice such as "v5p:2x2x2"; AotError if unknown or libtpu absent."""
  _require_libtpu()
  dims = _chip_dims(name)
  kwargs = {}
  if len(dims) <= 3 and math.prod(dims) < 4:
    # libtpu assumes 2x2 chips per host; a single-chip slice (v5e:1x1) has to say it has fewer.
    kwargs["chips_per_host_bounds"] = tuple(dims) + (1,) * (3 - len(dims))
  try:
    with _quiet_libtpu_init():
      return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs).devices)
  except RuntimeError as e:
    if "TPU support not installed" in str(e):
      raise AotError(f"libtpu is not installed; compiling for TPU needs it: {_INSTALL}") from None
    if "INVALID_ARGUMENT" in str(e):
      raise AotError(f"invalid TPU topology {name!r}: {first_line(e)}") from None
    raise


def hbm_per_device(devices: Sequence[jax.Device]) -> int:
  """HBM of one device: the chip's HBM split between the devices (cores) that share a chip."""
  kind = devices[0].device_kind
  if kind not in CHIP_HBM:
    raise AotError(f"no HBM size known for device kind {kind!r}; add it to CHIP_HBM")
  chips = {tuple(d.coords) for d in devices}
  return CHIP_HBM[kind] * len(chips) // len(devices)


def first_line(e: BaseException) -> str:
  return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
