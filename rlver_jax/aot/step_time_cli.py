"""`python -m rlver_jax.aot --estimate_time`: the step-time model's command line part.

  python -m rlver_jax.aot --config=configs/grpo_think.py --topology=v5p:2x4x4 --estimate_time
  python -m rlver_jax.aot --config=... --estimate_time --calls_from=WORKDIR/metrics.jsonl[:STEP]
  python -m rlver_jax.aot --config=configs/grpo_think.py:runlocal --topology=cpu --estimate_time \\
      --calls_from=... --chip_flops=6.1e10 --chip_bandwidth=1.2e10     # this machine, measured peaks

Without --calls_from the calls are laid out from stated lengths (--turns, --policy_tokens, ...; each
defaults to the config's budget, a lockstep step in which every turn uses its whole budget): the
roofline, a bound. The forecast prices the tokens a turn of a real run uses (--mean_policy_tokens,
--mean_simulator_tokens; `MEAN_SOURCES`). With a simulator draft (simulator.draft_checkpoint, or
--draft_preset as a what-if) the simulator decodes draft-and-verify at --draft_acceptance (`aot.draft`).
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
from rlver_jax.aot import draft as aot_draft
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


_MEAN = {k: flags.DEFINE_integer(f"mean_{k}", None, f"Forecast: {doc} in a real run (default: "
                                  "the stated length, see MEAN_SOURCES)")
         for k, doc in (("policy_tokens", "decode steps of a policy turn"),
                        ("simulator_tokens", "decode steps of a simulator answer"))}
# Where each forecast length comes from when its flag is not given: the stated length (--policy_tokens,
# ...: the budget unless given). The paper states no mean response length of either side
# (../shared/docs/RLVER_SPEC.md has none).
MEAN_SOURCES = {"policy_tokens": "as stated, by default the budget: RLVER reports no mean policy "
                                 "reply length",
                "simulator_tokens": "as stated, by default the budget: RLVER reports no mean "
                                    "simulator answer length"}
_DRAFT_PRESET = flags.DEFINE_string(
    "draft_preset", None, "The simulator's draft architecture (e.g. qwen2.5-0.5b) when "
    "simulator.draft_checkpoint has no config.json readable here; without the key, prices a draft "
    "as a what-if.")
_DRAFT_ACCEPTANCE = flags.DEFINE_float(
    "draft_acceptance", None, "Per-token acceptance of the draft's proposals (default: a recorded "
    f"step's simulator/draft_acceptance with --calls_from, else {aot_draft.DEFAULT_ACCEPTANCE:g}; "
    "see rlver_jax.aot.draft).")


def stated_lengths(spec: RunSpec) -> step_calls.StatedLengths:
  return step_calls.StatedLengths(**{k: f.value if f.value is not None else _LENGTHS[k][1](spec)
                                     for k, f in _LENGTH_FLAGS.items()})


def forecast_lengths(lengths: step_calls.StatedLengths) -> tuple[step_calls.StatedLengths, str]:
  """The lengths the forecast prices (the bound's, with the mean flags' values), and a line saying
  where each comes from."""
  values, said = {}, []
  for k, f in _MEAN.items():
    values[k] = f.value if f.value is not None else getattr(lengths, k)
    why = f"--mean_{k}" if f.value is not None else MEAN_SOURCES[k]
    said.append(f"{k.replace('_tokens', '')} {values[k]:,} tokens a turn ({why})")
  return dataclasses.replace(lengths, **values), (
      "forecast lengths: " + "; ".join(said) + ". In lockstep a turn decodes until its longest row "
      "stops, so a mean under the budget prices fewer decode steps than a lockstep step takes.")


def draft_model(spec: RunSpec):
  """The simulator's draft as the aot programs build it (`aot.draft.draft_shape`), or None."""
  try:
    return aot_draft.draft_shape(spec, _DRAFT_PRESET.value)
  except ValueError as e:
    raise AotError(str(e)) from None


def _draft(spec: RunSpec, found, measured: dict[str, float]) -> aot_draft.Draft | None:
  if found is None:
    if _DRAFT_ACCEPTANCE.value is not None:
      raise AotError("--draft_acceptance: no draft to price (set simulator.draft_checkpoint or "
                     "--draft_preset)")
    return None
  k = spec.simulator.draft_tokens
  ratio = measured.get("simulator/draft_acceptance")
  if _DRAFT_ACCEPTANCE.value is not None:
    a, why = _DRAFT_ACCEPTANCE.value, "--draft_acceptance"
  elif ratio is not None:
    a = aot_draft.acceptance_from_ratio(ratio, k)
    why = f"from the recorded simulator/draft_acceptance {ratio:.3f} (kept / proposed at k={k})"
  else:
    a, why = aot_draft.DEFAULT_ACCEPTANCE, "default: published Qwen2.5-0.5B pairs, docs/PERFORMANCE.md"
  try:
    return aot_draft.Draft(found[0], k, a, source=f"{found[0].preset} from {found[1]}; a = {a:.3f} "
                           f"({why})")
  except ValueError as e:
    raise AotError(str(e)) from None


def draft_line(spec: RunSpec, draft: aot_draft.Draft, layouts) -> str:
  """The draft's assumptions, for under the table."""
  d, s = (ap.model_config(m).vocab_size for m in (draft.model, ap.simulator_model(spec)))
  clash = (f"; it has more embedding rows ({d:,}) than the simulator ({s:,}): a run refuses it"
           if d > s else "")
  return (f"draft: {draft.source}; on {layouts.shape('simulator_draft')} (data x fsdp x tensor); "
          f"k = {draft.tokens} proposals a verify pass, {draft.per_pass:.2f} tokens a pass = "
          f"(1 - a^(k+1)) / (1 - a) (i.i.d. acceptance, Leviathan et al. 2023), kept share "
          f"{aot_draft.kept_share(draft.acceptance, draft.tokens):.3f}; a decode segment of n tokens "
          "takes (n - 1) / that + 1 passes (the lockstep batch's slowest row takes more: not "
          "priced) and k draft steps a pass but the closing one; the draft's appends are "
          f"priced with the prefills{clash}")


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


def _calls(spec: RunSpec, mesh, found):
  """(the bound's calls, the forecast's calls, measured seconds, where they come from, the draft,
  notes for under the table)."""
  if _CALLS_FROM.value is None:
    draft = _draft(spec, found, {})
    lengths = stated_lengths(spec)
    mean, note = forecast_lengths(lengths)
    calls = step_calls.stated_calls(spec, lengths, mesh, draft)
    at_mean = calls if mean == lengths else step_calls.stated_calls(spec, mean, mesh, draft)
    return calls, at_mean, {}, f"stated lengths {lengths}", draft, [note]
  given = [f"--mean_{k}" for k, f in _MEAN.items() if f.value is not None]
  if given:
    raise AotError(f"{given[0]}: stated lengths only (--calls_from prices the recorded step)")
  path, sep, step = _CALLS_FROM.value.rpartition(":")
  if not (sep and step.isdigit()):
    path, step = _CALLS_FROM.value, ""
  calls, measured = step_calls.calls_from_metrics(path, int(step) if step else None)
  draft = _draft(spec, found, measured)
  if draft is not None:
    calls = step_calls.with_draft(calls, draft)
  source = f"calls recorded in {path} (step {int(measured.get('step', 0))})"
  return calls, calls, measured, source, draft, []


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
  found = draft_model(spec)
  layouts = run_layouts(spec, devices, None, hbm, found and found[0])
  chip = _chip(devices)
  cache = CostCache(_CACHE.value) if _CACHE.value else None
  a = assumptions()
  try:
    calls, at_mean, measured, source, draft, notes = _calls(spec, layouts.train, found)
    model = step_time.CostModel(spec, layouts, layout=layout, cache=cache, draft=draft,
                                log=lambda line: print(line, file=sys.stderr, flush=True))
  except ValueError as e:
    raise AotError(str(e)) from None
  unknown = [p for p in _PHASES.value if p not in step_time.PHASES]
  if unknown:
    raise AotError(f"--phases: unknown phase {unknown[0]!r}; known: {', '.join(step_time.PHASES)}")
  fractions = (a.flops_fraction, a.memory_fraction)
  phases = step_time.estimate(model, calls, chip, tuple(_PHASES.value), fractions=fractions)
  if at_mean is not calls:
    step_time.forecast_from(phases, step_time.estimate(model, at_mean, chip, tuple(_PHASES.value),
                                                       fractions=fractions))
  if draft is not None:
    notes.append(draft_line(spec, draft, layouts))
  extra = forecast.extras(spec, at_mean, phases, layouts, a, recorded=_CALLS_FROM.value is not None)
  rows = ", ".join(f"{r} {model.rows(r)}" for r in ("policy", "simulator"))
  table = forecast.format_estimate(phases, chip, measured, header=(
      f"step-time model on {topology} ({layouts.describe()}; cache rows {rows}, {layout_word(spec)}; "
      f"simulator.info_flow {spec.simulator.info_flow!r}), {source}; {model.compiles} programs "
      f"costed{'; ' + cache.describe() if cache else ''}"),
      layouts=forecast.phase_layouts(layouts), extra=extra, a=a,
      programs=forecast.compile_programs({**calls, **at_mean}, phases), raised=len(model.raised))
  return "\n".join([table, *notes]) + _floors(spec, calls, phases, model, layouts, chip, len(devices))


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
  if any(k.startswith("simulator/verify_passes/") for k in calls):
    out += "\nfloor, simulator decode: not computed for a draft-and-verify decode"
  for role in ("policy", "simulator"):
    if f"{role}/peak_slots" in calls:
      slots = (spec.policy if role == "policy" else spec.simulator).max_context
      out += (f"\n{role} cache: a row fills at most {calls[f'{role}/peak_slots']:,.0f} of its "
              f"{slots:,} slots at these lengths")
  return out
