"""The whole-run memory plan of a training run (its `RunSpec`): its programs, and what is resident
in each phase.

A training step has two phases on one set of devices, each model in its layout (`aot.layouts`),
and the trainer keeps its whole state on device through both (`train.Trainer.state`, the simulator
backend's cache):

  rollout  policy params + policy optimizer state (+ critic params + critic optimizer state for PPO)
           (+ reference params when rl.kl_coef > 0) (+ the policy's decode copy in a serving layout)
           + simulator params + policy KV cache + simulator KV cache (+ the simulator's draft:
           its params and KV cache), plus the largest private need of one sampler program (the
           draft-and-verify program itself is not compiled here)
  update   the same without the policy KV cache (it belongs to the rollout and is dropped after it;
           the simulator backend keeps its cache between steps), plus the largest private need of one
           update program or of the reshard (policy decode copy refreshed from the training params)

A program's private need is what it adds to the resident state while it runs: temporaries + outputs
not aliased to (donated) arguments + generated code + its non-state inputs (token ids, logits, the
update's mini-batch). Run programs take their state as their first two arguments, so their state
arguments are not counted twice. Resident sizes are per-device shard sizes of the abstract arrays;
the run total is the larger phase.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, Sequence

import jax
from jax.sharding import Mesh

from rlver_jax.aot import programs as ap
from rlver_jax.spec import RunSpec
from rlver_jax.rl.update import make_optimizer

SAMPLER_KINDS = ("prefill", "append", "decode")


class Row(Protocol):
  """What the plan reads from a compiled program's memory row (`aot.MemoryRow`)."""
  program: str
  error: str | None
  argument_bytes: int | None
  total_bytes: int | None
  input_bytes: tuple[int, ...]


def has_simulator(spec: RunSpec) -> bool:
  return spec.simulator.backend == "model"


def rollout_programs(spec: RunSpec) -> tuple[str, ...]:
  roles = ("policy", "simulator") if has_simulator(spec) else ("policy",)
  return tuple(f"{role}_{kind}" for role in roles for kind in SAMPLER_KINDS)


def update_programs(spec: RunSpec) -> tuple[str, ...]:
  """The update's programs, then the reshard of the policy's decode copy (a serving layout)."""
  reshard = ("policy_reshard",) if spec.rollout.policy_mesh != "train" else ()
  # RunSpec admits grpo and ppo only.
  if spec.algo == "grpo":
    return ("grpo_update",) + reshard
  return ("ppo_policy_update", "ppo_critic_update") + reshard


def run_programs(spec: RunSpec) -> tuple[str, ...]:
  """Every program one training step runs, compiled at the run's real shapes."""
  return rollout_programs(spec) + update_programs(spec)


def search_order(names: Sequence[str]) -> list[str]:
  """Likely biggest first, so a search gives up after few compiles: updates, simulator, policy."""
  rank = lambda n: 2 if n.startswith("policy_") else 1 if n.startswith("simulator_") else 0
  return sorted(names, key=rank)


# -- sizes ---------------------------------------------------------------------------------------


def _leaf_bytes(x: jax.ShapeDtypeStruct) -> int:
  shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    itemsize = 8  # a threefry key is two uint32
  else:
    itemsize = x.dtype.itemsize
  return math.prod(shape) * itemsize


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (no layout padding)."""
  return sum(_leaf_bytes(x) for x in jax.tree.leaves(tree))


def _params_and_optimizer(spec: RunSpec, mesh: Mesh, critic: bool) -> tuple[int, int]:
  _, params = ap.abstract_params(ap.policy_model(spec), mesh, head="value" if critic else "lm")
  optimizer = make_optimizer(spec.optim.optim_config(critic=critic))
  return per_device_bytes(params), per_device_bytes(ap.abstract_opt_state(optimizer, params, mesh))


def _cache_bytes(spec: RunSpec, mesh: Mesh, role: str) -> int:
  model = ap.policy_decode_model(spec) if role == "policy" else ap.simulator_model(spec)
  section = spec.policy if role == "policy" else spec.simulator
  return per_device_bytes(ap.abstract_cache(ap.model_config(model), ap.rollout_rows(spec, mesh),
                                            section.max_context, ap.cache_dtype(model), mesh))


def resident_state(spec: RunSpec, layouts) -> dict[str, dict[str, int]]:
  """Per phase: {piece: per-device bytes} of the state that stays on device through it, each piece
  on its model's mesh (`aot.layouts.Layouts`): training state on `train`, the simulator and each
  KV cache in their decode layouts. The policy's decode copy stays resident through the update (the
  reshard writes into its donated buffers)."""
  train = layouts.train
  params, opt = _params_and_optimizer(spec, train, critic=False)
  common = {"policy params": params, "policy optimizer": opt}
  if spec.algo == "ppo":
    common["critic params"], common["critic optimizer"] = _params_and_optimizer(spec, train, True)
  if spec.rl.kl_coef > 0:
    common["reference params"] = params
  if layouts.policy_copy:
    _, copy = ap.abstract_params(ap.policy_decode_model(spec), layouts.policy)
    common["policy decode copy"] = per_device_bytes(copy)
  if has_simulator(spec):
    _, sim = ap.abstract_params(ap.simulator_model(spec), layouts.simulator)
    common["simulator params"] = per_device_bytes(sim)
    common["simulator KV cache"] = _cache_bytes(spec, layouts.simulator, "simulator")
  draft = getattr(layouts, "draft_model", None)
  if draft is not None:  # the simulator's draft: its weights and a cache of the same tokens
    _, params = ap.abstract_params(draft, layouts.draft)
    common["draft params"] = per_device_bytes(params)
    common["draft KV cache"] = per_device_bytes(ap.abstract_cache(
        ap.model_config(draft), ap.rollout_rows(spec, layouts.draft), spec.simulator.max_context,
        ap.cache_dtype(draft), layouts.draft))
  rollout = dict(common, **{"policy KV cache": _cache_bytes(spec, layouts.policy, "policy")})
  return {"rollout": rollout, "update": common}


def private_bytes(row: Row) -> int | None:
  """What a compiled run program adds to the resident state; None if it did not compile."""
  if row.error is not None:
    return None
  return row.total_bytes - row.argument_bytes + sum(row.input_bytes[2:])


# -- phases --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Phase:
  """One phase's per-device memory: resident state plus the largest program's private need."""
  name: str
  state: tuple[tuple[str, int], ...]
  program: str
  private_bytes: int | None   # None: some program of the phase did not compile (out of HBM)
  hbm_bytes: int

  @property
  def state_bytes(self) -> int:
    return sum(b for _, b in self.state)

  @property
  def total_bytes(self) -> int | None:
    return None if self.private_bytes is None else self.state_bytes + self.private_bytes

  @property
  def fits(self) -> bool:
    return self.total_bytes is not None and self.total_bytes <= self.hbm_bytes


class Plan:
  """The memory plan of one training run on one mesh: resident state per phase, then phases."""

  def __init__(self, spec: RunSpec, layouts, hbm_bytes: int):
    self.hbm_bytes = hbm_bytes
    self.state = resident_state(spec, layouts)
    self.programs = {"rollout": rollout_programs(spec), "update": update_programs(spec)}

  def phase_of(self, program: str) -> str:
    return next(name for name, programs in self.programs.items() if program in programs)

  def state_misfit(self, programs: Sequence[str]) -> str | None:
    """Why the resident state of a phase these programs run in cannot fit on its own, if it cannot."""
    for name in dict.fromkeys(self.phase_of(p) for p in programs):
      state = sum(self.state[name].values())
      if state > self.hbm_bytes:
        return f"{name} resident state {gib(state)} GiB alone exceeds HBM"
    return None

  def row_misfit(self, row: Row) -> str | None:
    """Why one compiled program cannot fit next to its phase's resident state, if it cannot."""
    private = private_bytes(row)
    if private is None:
      return f"{row.program} is out of HBM on its own"
    state = sum(self.state[self.phase_of(row.program)].values())
    if state + private > self.hbm_bytes:
      return (f"{row.program} adds {gib(private)} GiB to {gib(state)} GiB resident, "
              f"{gib(state + private)} GiB in all")
    return None

  def phases(self, rows: Sequence[Row]) -> tuple[Phase, ...]:
    """The phases all of whose programs are among `rows`."""
    by_name = {r.program: r for r in rows}
    out = []
    for name, programs in self.programs.items():
      if not all(p in by_name for p in programs):
        continue
      private = {p: private_bytes(by_name[p]) for p in programs}
      known = {p: b for p, b in private.items() if b is not None}
      worst = max(known, key=known.get) if known else programs[0]
      need = known[worst] if len(known) == len(private) else None
      out.append(Phase(name, tuple(self.state[name].items()), worst, need, self.hbm_bytes))
    return tuple(out)


def run_total(phases: Sequence[Phase]) -> Phase | None:
  """The phase that needs the most memory (the run's peak): None unless both phases are there."""
  if len(phases) < 2:
    return None
  unknown = [p for p in phases if p.total_bytes is None]
  return unknown[0] if unknown else max(phases, key=lambda p: p.total_bytes)


# -- output --------------------------------------------------------------------------------------


def gib(n: int | None) -> str:
  """Bytes as GiB with two decimals; "-" for None (a program that did not compile)."""
  return "-" if n is None else f"{n / 2**30:.2f}"


def phase_row(p: Phase, topology: str, mesh: str) -> tuple[str, ...]:
  """A phase as a row of aot's table: args = resident state, temps = the program's private need."""
  fits = "yes" if p.fits else "no" if p.total_bytes is not None else "no (a program is out of HBM)"
  return (f"{p.name} phase: resident state + {p.program}", topology, mesh, gib(p.state_bytes), "-",
          gib(p.private_bytes), gib(p.total_bytes), gib(p.hbm_bytes), fits)


def format_run_total(phases: Sequence[Phase], topology: str, mesh: str) -> str:
  """What each phase keeps resident and its largest program, then the run total per device."""
  lines = []
  for p in phases:
    pieces = " + ".join(f"{name} {gib(b)}" for name, b in p.state)
    lines.append(f"{p.name}: resident {pieces} = {gib(p.state_bytes)} GiB; its largest program "
                 f"{p.program} adds {gib(p.private_bytes)} GiB")
  peak = run_total(phases)
  if peak is not None:
    verdict = "fits" if peak.fits else "does not fit"
    lines.append(f"run total per device on {topology} (mesh {mesh}): {gib(peak.total_bytes)} GiB "
                 f"({peak.name} phase) of {gib(peak.hbm_bytes)} GiB HBM: {verdict}")
  return "\n".join(lines)
