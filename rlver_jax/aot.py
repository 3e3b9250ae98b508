"""Compile programs for a named TPU topology on a CPU machine and report their per-device memory.

  python -m rlver_jax.aot --config=configs/aot_forward.py:qwen2.5-72b --topology=v5p:2x2x2
  python -m rlver_jax.aot --config=configs/aot_forward.py --find_smallest
  python -m rlver_jax.aot --config=configs/grpo_think.py --topology=v5p:2x4x4 [--find_smallest]

With a training config (configs/grpo_think.py, ...) it compiles every program of one training step at
the config's real shapes and adds the whole-run plan (`rlver_jax.aot_run`): per phase, the resident
state plus the largest program's private need, and the run total = the larger phase.

Needs libtpu (`pip install "jax[tpu]==0.10.2"`), which can describe and compile for any slice without a
TPU attached. Programs come from `rlver_jax.aot_programs.PROGRAMS`; the config names them in
`config.programs` (a training config: `aot_run.run_programs`; `--programs=a,b` picks some). Memory
per device: arguments + temporaries + outputs not aliased to arguments + generated code (all of
which live in HBM on TPU). A compile that fails with RESOURCE_EXHAUSTED is a row that does not fit,
not a crash.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Sequence

import jax
import ml_collections
from absl import app, flags
from jax.experimental import topologies
from jax.sharding import Mesh
from ml_collections import config_flags

from rlver_jax import aot_run
from rlver_jax.aot_programs import PROGRAMS
from rlver_jax.cli_errors import exit_on
from rlver_jax.run_config import parse_flags
from rlver_jax.sharding import MeshConfig, make_mesh
from rlver_jax.train_checks import check_training_config

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
  input_bytes: tuple[int, ...] = ()  # per-device bytes of each argument, as passed to the program

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
  # Built outside the mesh context: builders may make small concrete arrays (a sampler's stop ids),
  # which must not be placed on compile-only devices.
  fn, args = PROGRAMS[name](config, mesh)
  row = MemoryRow(program=name, topology=topology, mesh=shape, hbm_bytes=hbm_bytes,
                  input_bytes=tuple(aot_run.per_device_bytes(a) for a in args))
  with jax.set_mesh(mesh):  # the model's activation constraints read the ambient mesh
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


def program_names(config: ml_collections.ConfigDict, only: Sequence[str] = ()) -> tuple[str, ...]:
  """`config.programs`, or every program of a training step for a training config; `only` filters."""
  names = aot_run.run_programs(config) if aot_run.is_run_config(config) else tuple(config.programs)
  unknown = [n for n in only if n not in names]
  if unknown:
    raise AotError(f"program {unknown[0]!r} is not one of this config's: {', '.join(names)}")
  return tuple(n for n in names if not only or n in only)


def _mesh(config: ml_collections.ConfigDict, devices: Sequence[jax.Device],
          mesh_config: MeshConfig | None) -> Mesh:
  if mesh_config is None:
    mesh_config = fitting_mesh(MeshConfig(config.mesh.data, config.mesh.fsdp, config.mesh.tensor),
                               len(devices))
  return make_mesh(mesh_config, devices)


def report(config: ml_collections.ConfigDict, topology: str,
           mesh_config: MeshConfig | None = None) -> list[MemoryRow]:
  """One row per program of the config (`program_names`), compiled for `topology`."""
  return list(evaluate(config, topology, mesh_config).rows)


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """Compiled rows of a config on one slice and mesh; phases (and run total) for training configs."""
  topology: str
  mesh: tuple[int, int, int]
  rows: tuple[MemoryRow, ...]
  phases: tuple[aot_run.Phase, ...] = ()
  stopped: str | None = None   # why the remaining programs were not compiled (a search gave up early)

  @property
  def fits(self) -> bool:
    return (self.stopped is None and all(r.fits for r in self.rows)
            and all(p.fits for p in self.phases))


def evaluate(config: ml_collections.ConfigDict, topology: str, mesh_config: MeshConfig | None = None,
             only: Sequence[str] = (), give_up_early: bool = False) -> Evaluation:
  """Compiles the programs of `config` for `topology`; adds the run plan for a training config.

  With `give_up_early` (a search), a training config compiles nothing when its resident state alone
  exceeds HBM, compiles its biggest programs (the updates) first, and stops at the first program
  that does not fit together with its phase's resident state.
  """
  devices = get_topology(topology)
  mesh = _mesh(config, devices, mesh_config)
  hbm = hbm_per_device(devices)
  shape = tuple(mesh.shape[a] for a in ("data", "fsdp", "tensor"))
  names = program_names(config, only)
  if not aot_run.is_run_config(config):
    return Evaluation(topology, shape, tuple(compile_program(n, config, mesh, topology, hbm)
                                             for n in names))
  try:
    check_training_config(config)  # what training would refuse (e.g. a zero micro-batch) is no plan
    plan = aot_run.Plan(config, mesh, hbm)
  except ValueError as e:  # an unknown preset, dtype or algorithm in the config
    raise AotError(str(e)) from None
  if give_up_early:
    why = plan.state_misfit(names)
    if why:
      return Evaluation(topology, shape, (), stopped=why)
    names = aot_run.search_order(names)
  rows = []
  for name in names:
    rows.append(compile_program(name, config, mesh, topology, hbm))
    why = plan.row_misfit(rows[-1]) if give_up_early and name != names[-1] else None
    if why:
      return Evaluation(topology, shape, tuple(rows), stopped=why)
  order = program_names(config, only)
  rows.sort(key=lambda r: order.index(r.program))
  return Evaluation(topology, shape, tuple(rows), plan.phases(rows))


@dataclasses.dataclass(frozen=True)
class Found:
  """The smallest slice of one family where every program fits, with the rows that showed it."""
  family: str
  topology: str
  rows: tuple[MemoryRow, ...]
  phases: tuple[aot_run.Phase, ...] = ()


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
                  log=print, only: Sequence[str] = ()) -> dict[str, Found | None]:
  """Per chip family, the smallest candidate slice (and mesh) on which every program fits.

  For a training config the run total has to fit too; slices whose resident state alone exceeds HBM
  are skipped without compiling.
  """
  unknown = [f for f in families if f not in CANDIDATES]
  if unknown:
    raise AotError(f"unknown chip family {unknown[0]!r}; known: {', '.join(CANDIDATES)}")
  results: dict[str, Found | None] = {}
  for family in families:
    results[family] = None
    for topology in CANDIDATES[family]:
      devices = get_topology(topology)
      for mesh_config in _search_meshes(config, len(devices)):
        ev = evaluate(config, topology, mesh_config, only, give_up_early=True)
        log(format_evaluation(ev, header=False))
        if ev.fits:
          results[family] = Found(family, topology, ev.rows, ev.phases)
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


def _table(lines: Sequence[tuple[str, ...]], header: bool) -> str:
  lines = ([_COLUMNS, tuple("---" for _ in _COLUMNS)] if header else []) + list(lines)
  return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def format_table(rows: Sequence[MemoryRow], header: bool = True) -> str:
  """A Markdown table (per-device sizes); outputs are those not aliased to arguments."""
  return _table([format_row(r) for r in rows], header)


def format_evaluation(ev: Evaluation, header: bool = True) -> str:
  """Program rows, then one row per phase; with `header`, the resident state and run-total lines."""
  mesh = "x".join(map(str, ev.mesh))
  lines = [format_row(r) for r in ev.rows] + [aot_run.phase_row(p, ev.topology, mesh) for p in ev.phases]
  if ev.stopped:
    lines.append(("(search gave up)", ev.topology, mesh) + ("-",) * 5 + (f"no ({ev.stopped})",))
  text = _table(lines, header)
  if header and ev.phases:
    text += "\n\n" + aot_run.format_run_total(ev.phases, ev.topology, mesh)
  return text


# -- CLI -------------------------------------------------------------------------------------------

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file naming the programs to compile.",
                                          lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x2", "TPU slice, e.g. v5e:4x4, v5p:2x2x2, v6e:2x4.")
_FIND = flags.DEFINE_bool("find_smallest", False,
                          "Search each chip family for the smallest slice on which every program fits.")
_FAMILIES = flags.DEFINE_list("families", list(CANDIDATES), "Chip families for --find_smallest.")
_ONLY = flags.DEFINE_list("programs", [], "Compile only these of the config's programs (default: all); "
                          "a training config's phase rows need all programs of that phase.")


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
    print(format_evaluation(evaluate(config, _TOPOLOGY.value, only=_ONLY.value)))
    return
  found = find_smallest(config, _FAMILIES.value, log=_streamed_table(), only=_ONLY.value)
  print()
  for family, f in found.items():
    if f is None:
      print(f"{family}: nothing up to {CANDIDATES[family][-1]} fits")
    else:
      mesh = f.rows[0].mesh
      print(f"{family}: smallest is {f.topology}, mesh data,fsdp,tensor = {'x'.join(map(str, mesh))}")
      if f.phases:
        total = aot_run.format_run_total(f.phases, f.topology, "x".join(map(str, mesh)))
        print("  " + total.replace("\n", "\n  "))


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/aot_forward.py")
  try:
    _run(_CONFIG.value)
  except (AotError, ValueError) as e:  # ValueError: a bad config value (e.g. an unknown preset)
    exit_on(e, prefix="aot: error")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
