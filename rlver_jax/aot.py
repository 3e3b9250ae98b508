"""Compile programs for a named TPU topology on a CPU machine and report their per-device memory.

  python -m rlver_jax.aot --config=configs/aot_forward.py:qwen2.5-72b --topology=v5p:2x2x2
  python -m rlver_jax.aot --config=configs/aot_forward.py --find_smallest

Needs libtpu (`pip install "jax[tpu]==0.10.2"`), which can describe and compile for any slice without a
TPU attached. Programs come from `rlver_jax.aot_programs.PROGRAMS`; the config names them in
`config.programs`. Memory per device: arguments + temporaries + outputs not aliased to arguments +
generated code (all of which live in HBM on TPU). A compile that fails with RESOURCE_EXHAUSTED is a row
that does not fit, not a crash.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Sequence

import jax
import ml_collections
from absl import app, flags
from jax.experimental import topologies
from jax.sharding import Mesh
from ml_collections import config_flags

from rlver_jax.aot_programs import PROGRAMS
from rlver_jax.sharding import MeshConfig, make_mesh

_GIB = 2**30
_INSTALL = 'pip install "jax[tpu]==0.10.2"'

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

# Meshes `--find_smallest` tries on each slice: FSDP over everything, then tensor parallel at 2/4/8.
_SEARCH_MESHES = (MeshConfig(1, -1, 1), MeshConfig(1, -1, 2), MeshConfig(1, -1, 4),
                  MeshConfig(1, -1, 8))


class AotError(Exception):
  """A user-facing error: printed as one line, exit status 1."""


@dataclasses.dataclass(frozen=True)
class MemoryRow:
  """Per-device memory of one compiled program; byte fields are None when the compile ran out of HBM."""
  program: str
  topology: str
  mesh: tuple[int, int, int]
  hbm_bytes: int
  argument_bytes: int | None = None
  output_bytes: int | None = None
  temp_bytes: int | None = None
  alias_bytes: int | None = None
  code_bytes: int | None = None
  error: str | None = None

  @property
  def total_bytes(self) -> int | None:
    if self.error:
      return None
    return (self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes
            + self.code_bytes)

  @property
  def fits(self) -> bool:
    return self.error is None and self.total_bytes <= self.hbm_bytes


# -- topologies ------------------------------------------------------------------------------------


def _quiet_libtpu_init() -> None:
  # Off a TPU VM libtpu cannot discover its host and logs warnings; these values only describe this
  # (compile-only) process, every topology is given explicitly.
  if not os.path.exists("/dev/accel0") and not os.path.exists("/dev/vfio"):
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


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
  _quiet_libtpu_init()
  try:
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs).devices)
  except RuntimeError as e:
    if "TPU support not installed" in str(e):
      raise AotError(f"libtpu is not installed; compiling for TPU needs it: {_INSTALL}") from None
    if "INVALID_ARGUMENT" in str(e):
      raise AotError(f"invalid TPU topology {name!r}: {_first_line(e)}") from None
    raise


def hbm_per_device(devices: Sequence[jax.Device]) -> int:
  """HBM of one device: the chip's HBM split between the devices (cores) that share a chip."""
  kind = devices[0].device_kind
  if kind not in CHIP_HBM:
    raise AotError(f"no HBM size known for device kind {kind!r}; add it to CHIP_HBM")
  chips = {tuple(d.coords) for d in devices}
  return CHIP_HBM[kind] * len(chips) // len(devices)


def _first_line(e: BaseException) -> str:
  return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# -- compiling -------------------------------------------------------------------------------------


def fitting_mesh(mesh_config: MeshConfig, num_devices: int) -> MeshConfig:
  """`mesh_config` if it divides the devices, else FSDP over all of them."""
  try:
    mesh_config.resolve(num_devices)
    return mesh_config
  except ValueError:
    return MeshConfig(data=1, fsdp=-1, tensor=1)


def compile_program(name: str, config: ml_collections.ConfigDict, mesh: Mesh, topology: str,
                    hbm_bytes: int) -> MemoryRow:
  """Lowers and compiles one registered program on `mesh`; RESOURCE_EXHAUSTED becomes a row."""
  if name not in PROGRAMS:
    raise AotError(f"unknown program {name!r}; registered: {', '.join(PROGRAMS)}")
  shape = tuple(mesh.shape[a] for a in ("data", "fsdp", "tensor"))
  row = MemoryRow(program=name, topology=topology, mesh=shape, hbm_bytes=hbm_bytes)
  with jax.set_mesh(mesh):  # the model's activation constraints read the ambient mesh
    fn, args = PROGRAMS[name](config, mesh)
    lowered = fn.lower(*args)
    try:
      compiled = lowered.compile()
    except Exception as e:  # pylint: disable=broad-except
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      return dataclasses.replace(row, error=_first_line(e))
  m = compiled.memory_analysis()
  return dataclasses.replace(
      row, argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
      temp_bytes=m.temp_size_in_bytes, alias_bytes=m.alias_size_in_bytes,
      code_bytes=m.generated_code_size_in_bytes)


def report(config: ml_collections.ConfigDict, topology: str,
           mesh_config: MeshConfig | None = None) -> list[MemoryRow]:
  """One row per program of `config.programs`, compiled for `topology`."""
  devices = get_topology(topology)
  if mesh_config is None:
    mesh_config = fitting_mesh(MeshConfig(config.mesh.data, config.mesh.fsdp, config.mesh.tensor),
                               len(devices))
  mesh = make_mesh(mesh_config, devices)
  hbm = hbm_per_device(devices)
  return [compile_program(name, config, mesh, topology, hbm) for name in config.programs]


@dataclasses.dataclass(frozen=True)
class Found:
  """The smallest slice of one family where every program fits, with the rows that showed it."""
  family: str
  topology: str
  rows: tuple[MemoryRow, ...]


def _search_meshes(config: ml_collections.ConfigDict, num_devices: int) -> list[MeshConfig]:
  """The config's mesh first, then the search meshes, each once, keeping those that divide."""
  first = MeshConfig(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  out, seen = [], set()
  for m in (first,) + _SEARCH_MESHES:
    try:
      shape = m.resolve(num_devices)
    except ValueError:
      continue
    if shape not in seen:
      seen.add(shape)
      out.append(m)
  return out


def find_smallest(config: ml_collections.ConfigDict, families: Sequence[str] = tuple(CANDIDATES),
                  log=print) -> dict[str, Found | None]:
  """Per chip family, the smallest candidate slice (and mesh) on which every program fits."""
  unknown = [f for f in families if f not in CANDIDATES]
  if unknown:
    raise AotError(f"unknown chip family {unknown[0]!r}; known: {', '.join(CANDIDATES)}")
  results: dict[str, Found | None] = {}
  for family in families:
    results[family] = None
    for topology in CANDIDATES[family]:
      devices = get_topology(topology)
      for mesh_config in _search_meshes(config, len(devices)):
        rows = report(config, topology, mesh_config)
        log(format_table(rows, header=False))
        if all(r.fits for r in rows):
          results[family] = Found(family, topology, tuple(rows))
          break
      if results[family]:
        break
  return results


# -- output ----------------------------------------------------------------------------------------


def _gib(n: int | None) -> str:
  return "-" if n is None else f"{n / _GIB:.2f}"


_COLUMNS = ("program", "topology", "mesh (data,fsdp,tensor)", "args GiB", "outputs GiB", "temps GiB",
            "total GiB", "HBM GiB", "fits")


def format_row(r: MemoryRow) -> tuple[str, ...]:
  fits = "yes" if r.fits else f"no ({r.error})" if r.error else "no"
  return (r.program, r.topology, "x".join(map(str, r.mesh)), _gib(r.argument_bytes),
          _gib(None if r.error else r.output_bytes - r.alias_bytes), _gib(r.temp_bytes),
          _gib(r.total_bytes), _gib(r.hbm_bytes), fits)


def format_table(rows: Sequence[MemoryRow], header: bool = True) -> str:
  """A Markdown table (per-device sizes); outputs are those not aliased to arguments."""
  lines = [_COLUMNS, tuple("---" for _ in _COLUMNS)] if header else []
  lines += [format_row(r) for r in rows]
  return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


# -- CLI -------------------------------------------------------------------------------------------

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file naming the programs to compile.",
                                          lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x2", "TPU slice, e.g. v5e:4x4, v5p:2x2x2, v6e:2x4.")
_FIND = flags.DEFINE_bool("find_smallest", False,
                          "Search each chip family for the smallest slice on which every program fits.")
_FAMILIES = flags.DEFINE_list("families", list(CANDIDATES), "Chip families for --find_smallest.")


def _streamed_table():
  """A `log` for find_smallest that prints the table header once, before the first rows."""
  started = []

  def log(rows: str) -> None:
    if not started:
      started.append(True)
      print(format_table([]))
    print(rows, flush=True)
  return log


def _run(config: ml_collections.ConfigDict) -> None:
  if not _FIND.value:
    print(format_table(report(config, _TOPOLOGY.value)))
    return
  found = find_smallest(config, _FAMILIES.value, log=_streamed_table())
  print()
  for family, f in found.items():
    if f is None:
      print(f"{family}: nothing up to {CANDIDATES[family][-1]} fits")
    else:
      print(f"{family}: smallest is {f.topology}, mesh data,fsdp,tensor = "
            f"{'x'.join(map(str, f.rows[0].mesh))}")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/aot_forward.py")
  try:
    _run(_CONFIG.value)
  except AotError as e:
    print(f"aot: error: {e}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
