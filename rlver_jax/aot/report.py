"""Compiling a config's programs for a TPU slice and reporting their per-device memory.

`evaluate` compiles every program of a target (`aot.target`: a training run's spec or an aot
config's) on one slice and mesh (with the whole-run plan of a training run, `aot.plan`);
`find_smallest` searches each chip family for the smallest slice on which all of it fits;
`format_evaluation` renders the Markdown table the command line prints.

Each program compiles on its model's mesh (`aot.layouts`): sampler programs in their decode layouts,
the updates and the reshard's source on the training mesh; a row's mesh column names it.

Memory per device: arguments + temporaries + outputs not aliased to arguments + generated code (all
of which live in HBM on TPU). A compile that fails with RESOURCE_EXHAUSTED is a row that does not
fit, not a crash.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import jax

from rlver_jax.aot import layouts as aot_layouts
from rlver_jax.aot import plan as run_plan
from rlver_jax.aot import target as aot_target
from rlver_jax.aot.target import Target
from rlver_jax.aot.plan import gib
from rlver_jax.aot.programs import PROGRAMS
from rlver_jax.aot.topology import CANDIDATES, AotError, first_line, get_topology, hbm_per_device
from rlver_jax.parallel.sharding import MeshConfig, make_mesh

# Meshes `--find_smallest` tries on each slice: FSDP over everything, then tensor parallel at 2/4/8.
_SEARCH_MESHES = (MeshConfig(1, -1, 1), MeshConfig(1, -1, 2), MeshConfig(1, -1, 4),
                  MeshConfig(1, -1, 8))


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


def fitting_mesh(mesh_config: MeshConfig, num_devices: int) -> MeshConfig:
  """`mesh_config` if it divides the devices, else FSDP over all of them."""
  try:
    mesh_config.resolve(num_devices)
    return mesh_config
  except ValueError:
    return MeshConfig(data=1, fsdp=-1, tensor=1)


def compile_program(name: str, target: Target, layouts: aot_layouts.Layouts,
                    topology: str, hbm_bytes: int) -> MemoryRow:
  """Lowers and compiles one program on its layout's mesh; RESOURCE_EXHAUSTED becomes a row."""
  if name not in PROGRAMS and name != aot_layouts.RESHARD:
    raise AotError(f"unknown program {name!r}; registered: {', '.join(PROGRAMS)}")
  mesh = layouts.for_program(name)
  shape = tuple(mesh.shape[a] for a in ("data", "fsdp", "tensor"))
  # Built outside the mesh context: builders may make small concrete arrays (a sampler's stop ids),
  # which must not be placed on compile-only devices.
  fn, args = aot_layouts.build(name, target, layouts)
  row = MemoryRow(program=name, topology=topology, mesh=shape, hbm_bytes=hbm_bytes,
                  input_bytes=tuple(run_plan.per_device_bytes(a) for a in args))
  # The model's activation constraints read the ambient mesh; the reshard spans two meshes whose
  # device orders differ, which jit refuses beside a context mesh.
  between = name == aot_layouts.RESHARD
  with contextlib.nullcontext() if between else jax.set_mesh(mesh):
    lowered = fn.lower(*args)
    try:
      compiled = lowered.compile()
    except Exception as e:  # pylint: disable=broad-except
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      return dataclasses.replace(row, error=first_line(e))
  m = compiled.memory_analysis()
  return dataclasses.replace(
      row, argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
      temp_bytes=m.temp_size_in_bytes, alias_bytes=m.alias_size_in_bytes,
      code_bytes=m.generated_code_size_in_bytes)


def program_names(target: Target, only: Sequence[str] = ()) -> tuple[str, ...]:
  """An aot config's `programs`, or every program of a training step for a run; `only` filters."""
  names = run_plan.run_programs(target) if aot_target.is_run(target) else target.programs
  unknown = [n for n in only if n not in names]
  if unknown:
    raise AotError(f"program {unknown[0]!r} is not one of this config's: {', '.join(names)}")
  return tuple(n for n in names if not only or n in only)


def _train_mesh_config(target: Target, devices: Sequence[jax.Device],
                       mesh_config: MeshConfig | None) -> MeshConfig:
  if mesh_config is None:
    mesh_config = fitting_mesh(target.mesh, len(devices))
  return MeshConfig(*mesh_config.resolve(len(devices)))


def run_layouts(target: Target, devices: Sequence[jax.Device],
                mesh_config: MeshConfig | None = None, hbm_bytes: int | None = None,
                draft=None) -> aot_layouts.Layouts:
  """Each model's mesh on `devices` (`aot.layouts`): one mesh for an aot config's programs;
  `draft`: the simulator's draft model (`aot.draft`), if any."""
  train = _train_mesh_config(target, devices, mesh_config)
  if not aot_target.is_run(target):
    return aot_layouts.single(make_mesh(train, devices))
  try:
    return aot_layouts.resolve(target, devices, train, hbm_bytes, draft)
  except ValueError as e:  # a decode layout that does not divide the devices or the heads
    raise AotError(str(e)) from None


def report(target: Target, topology: str,
           mesh_config: MeshConfig | None = None) -> list[MemoryRow]:
  """One row per program of the target (`program_names`), compiled for `topology`."""
  return list(evaluate(target, topology, mesh_config).rows)


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """Compiled rows of a target on one slice and mesh; phases (and run total) for a training run."""
  topology: str
  mesh: tuple[int, int, int]
  rows: tuple[MemoryRow, ...]
  phases: tuple[run_plan.Phase, ...] = ()
  stopped: str | None = None   # why the remaining programs were not compiled (a search gave up early)
  layouts: str = ""            # each model's mesh (`aot.layouts.Layouts.describe`)

  @property
  def fits(self) -> bool:
    return (self.stopped is None and all(r.fits for r in self.rows)
            and all(p.fits for p in self.phases))


def evaluate(target: Target, topology: str, mesh_config: MeshConfig | None = None,
             only: Sequence[str] = (), give_up_early: bool = False, draft=None) -> Evaluation:
  """Compiles the programs of `target` for `topology`; adds the run plan for a training run.

  With `give_up_early` (a search), a training run compiles nothing when its resident state alone
  exceeds HBM, compiles its biggest programs (the updates) first, and stops at the first program
  that does not fit together with its phase's resident state.
  """
  devices = get_topology(topology)
  hbm = hbm_per_device(devices)
  names = program_names(target, only)
  layouts = run_layouts(target, devices, mesh_config, hbm, draft)
  shape = tuple(layouts.train.shape[a] for a in ("data", "fsdp", "tensor"))
  if not aot_target.is_run(target):
    return Evaluation(topology, shape, tuple(compile_program(n, target, layouts, topology, hbm)
                                             for n in names))
  described = layouts.describe()
  try:
    plan = run_plan.Plan(target, layouts, hbm)
  except ValueError as e:  # an unknown preset or dtype
    raise AotError(str(e)) from None
  if give_up_early:
    why = plan.state_misfit(names)
    if why:
      return Evaluation(topology, shape, (), stopped=why, layouts=described)
    names = run_plan.search_order(names)
  rows = []
  for name in names:
    rows.append(compile_program(name, target, layouts, topology, hbm))
    why = plan.row_misfit(rows[-1]) if give_up_early and name != names[-1] else None
    if why:
      return Evaluation(topology, shape, tuple(rows), stopped=why, layouts=described)
  order = program_names(target, only)
  rows.sort(key=lambda r: order.index(r.program))
  return Evaluation(topology, shape, tuple(rows), plan.phases(rows), layouts=described)


@dataclasses.dataclass(frozen=True)
class Found:
  """The smallest slice of one family where every program fits, with the rows that showed it."""
  family: str
  topology: str
  rows: tuple[MemoryRow, ...]
  phases: tuple[run_plan.Phase, ...] = ()
  layouts: str = ""


def _search_meshes(target: Target, num_devices: int) -> list[MeshConfig]:
  """The target's mesh first, then the search meshes, each once, keeping those that divide."""
  out, seen = [], set()
  for m in (target.mesh,) + _SEARCH_MESHES:
    try:
      shape = m.resolve(num_devices)
    except ValueError:
      continue
    if shape not in seen:
      seen.add(shape)
      out.append(m)
  return out


def find_smallest(target: Target, families: Sequence[str] = tuple(CANDIDATES),
                  log=print, only: Sequence[str] = ()) -> dict[str, Found | None]:
  """Per chip family, the smallest candidate slice (and mesh) on which every program fits.

  For a training run the run total has to fit too; slices whose resident state alone exceeds HBM
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
      for mesh_config in _search_meshes(target, len(devices)):
        try:
          ev = evaluate(target, topology, mesh_config, only, give_up_early=True)
        except AotError as e:  # an explicit decode layout that this slice's devices do not divide
          shape = "x".join(map(str, mesh_config.resolve(len(devices))))
          log(_table([("(skipped)", topology, shape) + ("-",) * 5 + (f"no ({e})",)], False))
          continue
        log(format_evaluation(ev, header=False))
        if ev.fits:
          results[family] = Found(family, topology, ev.rows, ev.phases, ev.layouts)
          break
      if results[family]:
        break
  return results


_COLUMNS = ("program", "topology", "mesh (data,fsdp,tensor)", "args GiB", "outputs GiB", "temps GiB",
            "total GiB", "HBM GiB", "fits")


def format_row(r: MemoryRow) -> tuple[str, ...]:
  fits = "yes" if r.fits else f"no ({r.error})" if r.error else "no"
  return (r.program, r.topology, "x".join(map(str, r.mesh)), gib(r.argument_bytes),
          gib(None if r.error else r.output_bytes - r.alias_bytes), gib(r.temp_bytes),
          gib(r.total_bytes), gib(r.hbm_bytes), fits)


def _table(lines: Sequence[tuple[str, ...]], header: bool) -> str:
  lines = ([_COLUMNS, tuple("---" for _ in _COLUMNS)] if header else []) + list(lines)
  return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def format_table(rows: Sequence[MemoryRow], header: bool = True) -> str:
  """A Markdown table (per-device sizes); outputs are those not aliased to arguments."""
  return _table([format_row(r) for r in rows], header)


def format_evaluation(ev: Evaluation, header: bool = True) -> str:
  """Program rows, then one row per phase; with `header`, the resident state and run-total lines."""
  mesh = "x".join(map(str, ev.mesh))
  lines = [format_row(r) for r in ev.rows] + [run_plan.phase_row(p, ev.topology, mesh) for p in ev.phases]
  if ev.stopped:
    lines.append(("(search gave up)", ev.topology, mesh) + ("-",) * 5 + (f"no ({ev.stopped})",))
  text = _table(lines, header)
  if header and ev.layouts:
    text += f"\n\nlayouts: {ev.layouts}"
  if header and ev.phases:
    text += "\n\n" + run_plan.format_run_total(ev.phases, ev.topology, mesh)
  return text
