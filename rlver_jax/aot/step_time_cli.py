"""`python -m rlver_jax.aot --estimate_time`: the step-time model's command line part.

  python -m rlver_jax.aot --config=configs/grpo_think.py --topology=v5p:2x4x4 --estimate_time
  python -m rlver_jax.aot --config=... --estimate_time --calls_from=WORKDIR/metrics.jsonl[:STEP]
  python -m rlver_jax.aot --config=configs/grpo_think.py:runlocal --topology=cpu --estimate_time \\
      --calls_from=... --chip_flops=6.1e10 --chip_bandwidth=1.2e10     # this machine, measured peaks

Without --calls_from the calls are laid out from stated lengths (--turns, --policy_tokens, ...; each
defaults to the config's budget, a lockstep step in which every turn uses its whole budget).
The forecast's assumptions are flags too (--memory_fraction, ...: `aot.forecast.Assumptions`), and
compiled programs' costs are kept in --cost_cache (`aot.cost_cache`).
"""
from __future__ import annotations

import dataclasses
import sys

import jax
from absl import flags

from rlver_jax.aot import plan as run_plan
from rlver_jax.aot import programs as ap
from rlver_jax.aot import floor, forecast, step_calls, step_time
from rlver_jax.aot.cost_cache import DEFAULT_DIR, CostCache
from rlver_jax.aot import target as aot_target
from rlver_jax.aot.chips import ChipSpec, chip_for_kind
from rlver_jax.aot.report import run_layouts
from rlver_jax.aot.topology import AotError, get_topology, hbm_per_device
from rlver_jax.sampling.kv_cache import default_layout
from rlver_jax.spec import RunSpec

_CALLS_FROM = flags.DEFINE_string("calls_from", None, "metrics.jsonl[:STEP] whose calls/* to cost "
                                  "(default: stated lengths).")
_ROWS = flags.DEFINE_integer("rows", None, "Dialogues holding cache rows at once (continuous batching; "
                             "default: the config's rollout.rows; 0 = lockstep, every dialogue).")
_PHASES = flags.DEFINE_list("phases", list(step_time.PHASES), "Phases to estimate (each program "
                            "compiles for minutes here): " + ", ".join(step_time.PHASES))
_FLOPS = flags.DEFINE_float("chip_flops", None, "Peak FLOP/s per device (default: the chip's nominal).")
_BANDWIDTH = flags.DEFINE_float("chip_bandwidth", None, "Memory bytes/s per device (default: nominal).")
_CACHE = flags.DEFINE_string("cost_cache", DEFAULT_DIR, "Directory of compiled programs' costs, "
                             "keyed by their HLO fingerprint ('' = compile everything).")
_ASSUME = {f.name: flags.DEFINE_float(f.name, None, f"Forecast: {f.name.replace('_', ' ')} "
                                      f"(default {f.default:g}; see rlver_jax.aot.forecast)")
           for f in dataclasses.fields(forecast.Assumptions)}
_LENGTHS = {
    "turns": ("policy replies per dialogue", lambda c: c.simulator.max_turns),
    "policy_tokens": ("decode steps per policy turn", lambda c: c.policy.max_new_tokens),
    "reply_tokens": ("visible reply tokens per policy turn", lambda c: 128),
    "user_tokens": ("tokens of a user line", lambda c: 64),
    "simulator_tokens": ("decode steps per simulator answer", lambda c: c.simulator.max_new_tokens),
    "policy_prompt": ("tokens of the policy's opening prompt", lambda c: 512),
    "simulator_prompt": ("tokens of the simulator's first prompt", lambda c: 1536),
    "instruction_tokens": ("tokens of an emotion / reply instruction", lambda c: 256),
}
_LENGTH_FLAGS = {k: flags.DEFINE_integer(k, None, f"{doc} (stated-lengths mode)")
                 for k, (doc, _) in _LENGTHS.items()}


def stated_lengths(spec: RunSpec) -> step_calls.StatedLengths:
  return step_calls.StatedLengths(**{k: f.value if f.value is not None else _LENGTHS[k][1](spec)
                                     for k, f in _LENGTH_FLAGS.items()})


def assumptions() -> forecast.Assumptions:
  try:
    return forecast.Assumptions(**{k: f.value for k, f in _ASSUME.items() if f.value is not None})
  except ValueError as e:
    raise AotError(str(e)) from None


def layout_word(spec: RunSpec) -> str:
  """How the rollout shares its cache rows: "lockstep" or "continuous, R rows"."""
  rows = spec.rollout.rows
  return "lockstep" if not rows else f"continuous, {ap.lent_rows(spec)} rows"


def _devices(topology: str):
  return jax.devices("cpu") if topology == "cpu" else get_topology(topology)


def _chip(devices) -> ChipSpec:
  if _FLOPS.value is not None and _BANDWIDTH.value is not None:
    return ChipSpec(devices[0].device_kind, _FLOPS.value, _BANDWIDTH.value)
  try:
    nominal = chip_for_kind(devices[0].device_kind)
  except ValueError as e:
    raise AotError(str(e)) from None
  return dataclasses.replace(nominal, flops_per_s=_FLOPS.value or nominal.flops_per_s,
                             bytes_per_s=_BANDWIDTH.value or nominal.bytes_per_s)


def _calls(spec: RunSpec, mesh):
  if _CALLS_FROM.value is None:
    lengths = stated_lengths(spec)
    return step_calls.stated_calls(spec, lengths, mesh), {}, f"stated lengths {lengths}"
  path, sep, step = _CALLS_FROM.value.rpartition(":")
  if not (sep and step.isdigit()):
    path, step = _CALLS_FROM.value, ""
  calls, measured = step_calls.calls_from_metrics(path, int(step) if step else None)
  return calls, measured, f"calls recorded in {path} (step {int(measured.get('step', 0))})"


def run_estimate(spec: aot_target.Target, topology: str) -> str:
  """The step-time table for a training run's `spec` on `topology` ("cpu": this machine's devices)."""
  if not aot_target.is_run(spec):
    raise AotError("--estimate_time needs a training config (configs/grpo_think.py, ...)")
  if _ROWS.value is not None:  # checked like the config value
    try:
      spec = aot_target.with_rollout_rows(spec, _ROWS.value)
    except ValueError as e:
      raise AotError(str(e)) from None
  devices = _devices(topology)
  layout = default_layout("cpu") if topology == "cpu" else ap.TPU_CACHE_LAYOUT
  hbm = None if topology == "cpu" else hbm_per_device(devices)
  layouts = run_layouts(spec, devices, None, hbm)
  chip = _chip(devices)
  cache = CostCache(_CACHE.value) if _CACHE.value else None
  a = assumptions()
  try:
    calls, measured, source = _calls(spec, layouts.train)
    model = step_time.CostModel(spec, layouts, layout=layout, cache=cache,
                                log=lambda line: print(line, file=sys.stderr, flush=True))
  except ValueError as e:
    raise AotError(str(e)) from None
  unknown = [p for p in _PHASES.value if p not in step_time.PHASES]
  if unknown:
    raise AotError(f"--phases: unknown phase {unknown[0]!r}; known: {', '.join(step_time.PHASES)}")
  phases = step_time.estimate(model, calls, chip, tuple(_PHASES.value),
                              fractions=(a.flops_fraction, a.memory_fraction))
  extra = forecast.extras(spec, calls, phases, layouts, a, recorded=_CALLS_FROM.value is not None)
  rows = ", ".join(f"{r} {model.rows(r)}" for r in ("policy", "simulator"))
  table = forecast.format_estimate(phases, chip, measured, header=(
      f"step-time model on {topology} ({layouts.describe()}; cache rows {rows}, {layout_word(spec)}; "
      f"simulator.info_flow {spec.simulator.info_flow!r}), {source}; {model.compiles} programs "
      f"costed{'; ' + cache.describe() if cache else ''}"),
      layouts=forecast.phase_layouts(layouts), extra=extra, a=a,
      programs=forecast.compile_programs(calls, phases), raised=len(model.raised))
  return table + _floors(spec, calls, phases, model, layouts, chip, len(devices))


def _floors(spec, calls, phases, model, layouts, chip, n) -> str:
  """The floor of each decode, where its bytes go, and the rows' peak cache fill."""
  floors = [f for f in (floor.decode_floor(spec, calls, r, n, chip)
                        for r in ("policy", "simulator")) if f and f"{f.role} decode" in phases]
  seconds = {f.role: (phases[f"{f.role} decode"].seconds, phases[f"{f.role} decode"].seconds_with_links)
             for f in floors}
  splits = {}
  for f in floors:
    decode_model = ap._sampler_role(spec, f.role)[0]
    shard = run_plan.per_device_bytes(ap.abstract_params(decode_model, layouts.for_role(f.role))[1])
    splits[f.role] = floor.Split(*model.decode_bytes_line(f.role), floor.kv_bytes_per_slot(
        decode_model) * model.rows(f.role) / n, shard)
  out = ("\n\n" + floor.format_floors(floors, seconds, n, splits, chip)) if floors else ""
  for role in ("policy", "simulator"):
    if f"{role}/peak_slots" in calls:
      slots = (spec.policy if role == "policy" else spec.simulator).max_context
      out += (f"\n{role} cache: a row fills at most {calls[f'{role}/peak_slots']:,.0f} of its "
              f"{slots:,} slots at these lengths")
  return out
