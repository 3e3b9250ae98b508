"""From the roofline (a bound) to a forecast of a step, and the table that shows both.

The roofline prices each call at the chip's nominal peaks (`aot.step_time`). The forecast prices it
at achievable fractions of them, adds the link time of the collectives nothing overlaps, and adds
the step's costs that no program holds: parse retries, host round trips, the checkpoint save and
the held-out evaluation amortised over their intervals. Compile time is listed apart, as time to
first step. Each figure it uses is an `Assumptions` field, printed under the table.

Default fractions, from published measurements (sources in docs/PERFORMANCE.md):
  memory 0.44: vLLM on TPU v6e-8 serving Llama-3.3-70B in TP8 reaches ~44-52% of its HBM roofline
    (AI-Hypercomputer tpu-recipes, 64-128 concurrent requests, 1k in / 1k out); this project's 7B
    decode on an H200 reached 35% (docs/PERFORMANCE.md, "A decode step against its dots").
  FLOPs 0.50: MaxText's published pre-training MFU, 44-50% on v6e and 53-65% on v5p (its "optimized
    models tiering" page); an RL update of small micro-batches sits toward the low end.
"""
from __future__ import annotations

import dataclasses
import math

import jax

from rlver_jax.aot import programs as ap
from rlver_jax.aot.chips import ChipSpec
from rlver_jax.aot.layouts import Layouts
from rlver_jax.aot.step_time import PHASES, PhaseTime
from rlver_jax.rl.update import make_optimizer
from rlver_jax.spec import RunSpec


@dataclasses.dataclass(frozen=True)
class Assumptions:
  """What the forecast takes as given (each a flag of `--estimate_time`)."""
  memory_fraction: float = 0.44        # of nominal HBM bandwidth a program reaches
  flops_fraction: float = 0.50         # of peak FLOP/s
  parse_failure_rate: float = 0.01     # of simulator answers re-asked (unmeasured on a real simulator)
  segment_round_trip_s: float = 0.010  # host work between two decode segments (stop check, dispatch)
  text_round_trip_s: float = 0.100     # decode -> text -> parse -> template -> tokens, all rows
  host_copy_bytes_per_s: float = 5e9   # device -> host per chip, the blocking part of an async save
  compile_s: float = 20.0              # one program's compile on the TPU host

  def __post_init__(self):
    for name in ("memory_fraction", "flops_fraction"):
      if not 0 < getattr(self, name) <= 1:
        raise ValueError(f"--{name}={getattr(self, name)}: must be in (0, 1]")
    if not 0 <= self.parse_failure_rate < 1:
      raise ValueError(f"--parse_failure_rate={self.parse_failure_rate}: must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class Extra:
  """A per-step cost outside the programs: seconds a step, and how it was counted."""
  name: str
  seconds: float
  how: str


def state_bytes(spec: RunSpec, layouts: Layouts) -> int:
  """Bytes of what a checkpoint saves, all shards: trained params and optimizer state (policy, and
  the critic's for PPO)."""
  total = 0
  for critic in (False, True) if spec.algo == "ppo" else (False,):
    _, params = ap.abstract_params(ap.policy_model(spec), layouts.train,
                                   head="value" if critic else "lm")
    opt = ap.abstract_opt_state(make_optimizer(spec.optim.optim_config(critic=critic)), params,
                                layouts.train)
    total += sum(math.prod(x.shape) * x.dtype.itemsize
                 for x in (*jax.tree.leaves(params), *jax.tree.leaves(opt)))
  return total


def extras(spec: RunSpec, calls: dict[str, float], phases: dict[str, PhaseTime],
           layouts: Layouts, a: Assumptions, recorded: bool) -> list[Extra]:
  """The step's costs outside its programs, at the forecast's prices."""
  out = []
  sim = phases.get("simulator decode")
  rounds = calls.get("simulator/answer_rounds", 0.0)
  if recorded:
    out.append(Extra("parse retries", 0.0, "in the recorded calls already"))
  elif sim is not None and rounds:
    rows = ap.lent_rows(spec)
    p_round = 1 - (1 - a.parse_failure_rate) ** rows
    # In lockstep a retry decodes for the whole batch: an answer round's decode again.
    out.append(Extra("parse retries", p_round * sim.forecast, (
        f"{rounds:.0f} answer rounds a dialogue, each re-asked with probability 1 - (1 - "
        f"{a.parse_failure_rate:g})^{rows} rows = {p_round:.2f}, a retry as long as an average "
        "round of the simulator decode")))
  segments = sum(calls.get(k, 0.0) for k in ("policy/decode_calls", "simulator/decode_calls",
                                              "simulator/verify_calls"))
  texts = calls.get("host/text_round_trips", 0.0)
  note = ""
  if not texts:  # a recorded step does not count them: a full dialogue's turns and answers
    texts, note = 2 * spec.simulator.max_turns, " (2 x simulator.max_turns)"
  out.append(Extra("host round trips", segments * a.segment_round_trip_s + texts * a.text_round_trip_s,
                   f"{segments:.0f} decode segments x {a.segment_round_trip_s * 1e3:g} ms + "
                   f"{texts:.0f} text round trips{note} x {a.text_round_trip_s * 1e3:g} ms"))
  every = spec.checkpoint.every_steps
  if every:
    saved = state_bytes(spec, layouts)
    n = layouts.train.devices.size
    out.append(Extra("checkpoint save", saved / (n * a.host_copy_bytes_per_s) / every, (
        f"{saved / 1e9:,.1f} GB of params and optimizer state copied off {n} chips at "
        f"{a.host_copy_bytes_per_s / 1e9:g} GB/s each, every {every} steps (the write itself is "
        "asynchronous)")))
  if spec.eval.every_steps:
    rollout = sum(p.forecast for name, p in phases.items() if name not in ("update", "reshard"))
    scale = spec.eval.max_turns / spec.simulator.max_turns
    out.append(Extra("held-out evaluation", rollout * scale / spec.eval.every_steps, (
        f"one rollout of {spec.eval.max_turns} turns every {spec.eval.every_steps} steps, priced "
        "as the step's rollout forecast (an upper bound: fewer dialogues read less cache)")))
  return out


def compile_programs(calls: dict[str, float], phases: dict[str, PhaseTime]) -> int:
  """Programs the first step compiles: one per sampler shape called (a draft-and-verify decode:
  one per verify window, its draft steps inside), update, scoring, reshard."""
  shapes = {k.replace("/prefill/", "/append/") for k, n in calls.items() if n and k.count("/") >= 2
            and k.split("/")[1] in ("append", "prefill", "decode_steps", "verify_passes")}
  return len(shapes) + sum(1 for name in ("update", "reshard") if phases.get(name)
                           and phases[name].calls) + (1 if calls.get("forward/micro_batches") else 0)


def phase_layouts(layouts: Layouts) -> dict[str, str]:
  """The mesh (data x fsdp x tensor) each phase's programs ran on, for the table."""
  policy, sim, train = (layouts.shape(r) for r in ("policy", "simulator", "train"))
  draft = getattr(layouts, "draft", None) is not None and layouts.shape("simulator_draft")
  return {"policy decode": policy, "simulator decode": sim + (f" (draft {draft})" if draft else ""),
          "prefills": f"policy {policy}, simulator {sim}" + (f", draft {draft}" if draft else ""),
          "update": train, "reshard": f"{train} -> {policy}"}


def format_estimate(phases: dict[str, PhaseTime], chip: ChipSpec, measured: dict[str, float],
                    header: str, layouts: dict[str, str] | None = None,
                    extra: list[Extra] = (), a: Assumptions | None = None,
                    programs: int = 0, raised: int = 0) -> str:
  """The phases as a Markdown table (roofline and forecast), the costs outside the programs, the
  step's totals, the measured seconds if known, and every assumption."""
  a, layouts = a or Assumptions(), layouts or {}
  lines = [header, "", "| phase | layout | calls | TFLOP / device | HBM GB / device | "
           "link GB / device | collectives (exposed) | roofline s (a bound) | bound | "
           "roofline with link time s | forecast s |", "| --- " * 11 + "|"]
  for name, p in phases.items():
    lines.append(f"| {name} | {layouts.get(name, '-')} | {p.calls:,.0f} | {p.cost.flops / 1e12:.3f} | "
                 f"{p.cost.bytes / 1e9:.2f} | {p.cost.link_bytes / 1e9:.2f} | {p.cost.link_ops:,.0f} "
                 f"({p.cost.exposed_ops:,.0f}) | {p.seconds:.3f} | {p.bound} | "
                 f"{p.seconds_with_links:.3f} | {p.forecast:.3f} |")
  for name in PHASES:
    if name not in phases:
      lines.append(f"| {name} | {layouts.get(name, '-')} | not estimated (--phases) |" + " |" * 8)
  total = sum(p.seconds for p in phases.values())
  update = phases["update"].seconds if "update" in phases else 0.0
  rollout = total - update - (phases["reshard"].seconds if "reshard" in phases else 0.0)
  linked = sum(p.seconds_with_links for p in phases.values())
  programs_forecast = sum(p.forecast for p in phases.values())
  outside = sum(e.seconds for e in extra)
  partial = "" if set(phases) == set(PHASES) else " (estimated phases only)"
  lines.append(f"| step{partial} | | | | | | | {total:.3f} | rollout {rollout:.3f} s, update "
               f"{update:.3f} s | {linked:.3f} | {programs_forecast:.3f} |")
  if extra:
    lines += ["", "| outside the programs, per step | forecast s | counted as |", "| --- | --- | --- |"]
    lines += [f"| {e.name} | {e.seconds:.3f} | {e.how} |" for e in extra]
  lines.append(f"\nstep{partial}: roofline {total:.1f} s (a bound), with link time {linked:.1f} s "
               f"(a bound); forecast {programs_forecast + outside:.1f} s (programs "
               f"{programs_forecast:.1f} s + outside them {outside:.1f} s)")
  if programs:
    lines.append(f"time to first step: {programs} programs compiled x {a.compile_s:g} s = "
                 f"{programs * a.compile_s / 60:.1f} min (a forecast; a warm compilation cache "
                 "skips it)")
  if "rollout_seconds" in measured:
    got = measured["rollout_seconds"] + measured.get("update_seconds", 0.0)
    lines.append(f"\nmeasured: rollout {measured['rollout_seconds']:.2f} s, update "
                 f"{measured.get('update_seconds', 0.0):.2f} s; measured / roofline = "
                 f"{measured['rollout_seconds'] / max(rollout, 1e-12):.2f} (rollout), "
                 f"{measured.get('update_seconds', 0.0) / max(update, 1e-12):.2f} "
                 f"(update), {got / max(total, 1e-12):.2f} (step)")
  lines.append(
      f"\nassumptions: {chip.name} at {chip.flops_per_s / 1e12:g} TFLOP/s, "
      f"{chip.bytes_per_s / 1e9:g} GB/s memory and {chip.link_bytes_per_s / 1e9:g} GB/s "
      f"interconnect per device, {chip.hop_latency_s * 1e6:g} us per ring step of a collective. "
      "Roofline: each call at the larger of its FLOP and memory time (XLA's cost analysis per "
      "device, loops unrolled, 3-4 layers extrapolated with a layer adding at least its weight "
      f"shard and the cache it reads{f' ({raised} sampler shapes raised to it)' if raised else ''}, "
      "windows interpolated); with link time: also at its collectives' link time if larger (bytes "
      "and ops from the HLO, ring algorithms). Forecast: each call at max(FLOP time / "
      f"{a.flops_fraction:g}, memory time / {a.memory_fraction:g}, overlapped link time) + the "
      "link time of its exposed collectives (synchronous, or async with no work scheduled before "
      "their use; the update's and the reshard's taken as overlapped), plus the costs outside the "
      "programs above. Both: the optimizer update once "
      "per micro-batch; scoring passes (old and reference log-probs, critic values) costed as "
      "the policy's log-prob pass; the reshard (training params cast and moved to the policy's "
      "decode layout) once per step; no dispatch beyond the stated round trips.")
  return "\n".join(lines)
