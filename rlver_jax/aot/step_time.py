"""A step-time model: XLA's cost analysis of each compiled program of a step, a roofline per call,
times the step's calls (`aot.step_calls`: recorded by the trainer, or from stated lengths).

Per call (per device: an SPMD program's cost is one partition's): seconds = max(flops / peak FLOP/s,
bytes accessed / memory bandwidth), the chip's nominal peaks (`aot.chips`). The collectives (ICI) are
priced apart, as link time = their bytes / link bandwidth + their ring steps x the per-hop latency
(`aot.collectives`): the "with link time" figures take the larger of that and the roofline. The
forecast (`Cost.forecast`, `aot.forecast`) prices each call at achievable shares of the peaks plus
the link time of its exposed collectives; host work between calls is priced there, not here.
Compiled costs are kept on disk by the program's fingerprint (`aot.cost_cache`).

XLA's cost analysis counts a loop body once. So the programs are traced with their loops unrolled
(layer scans, query-block and logits-chunk maps, the top-p bisection: `unrolled_loops`) at 3 and 4
layers (`_depths`), and the cost is extrapolated linearly to the model's depth; the decode's `while_loop` is
traced as one iteration, so its cost is one decode step. A sampler program's cost is linear in its
attended window W (keys, values, masks): each is compiled at the smallest and the largest window and
interpolated. With a draft (`aot.draft`) the simulator's decode is priced as its verify passes
(`call_programs.verify_call`, on the simulator's mesh) and the draft's steps
(`call_programs.draft_step_call`, on the draft's), each compiled like a decode step.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import jax
from jax.sharding import Mesh

from rlver_jax.aot import call_programs as cp
from rlver_jax.aot import programs as ap
from rlver_jax.aot.chips import ChipSpec
from rlver_jax.aot.collectives import collective_links, exposed_links
from rlver_jax.aot.cost_cache import CostCache, fingerprint
from rlver_jax.aot.draft import Draft
from rlver_jax.aot.layouts import Layouts
from rlver_jax.aot.plan import per_device_bytes as plan_bytes
from rlver_jax.aot.step_calls import Calls, sampler_keys
from rlver_jax.sampling.sampler import window_buckets
from rlver_jax.spec import RunSpec

PHASES = ("policy decode", "simulator decode", "prefills", "update", "reshard")


@dataclasses.dataclass(frozen=True)
class Cost:
  """Per-device work of one call: floating-point operations, bytes of memory accessed, and its
  collectives (`aot.collectives`): bytes sent over the interconnect, how many, and their ring steps
  (each paying the link's latency); the `exposed_*` ones are those nothing overlaps
  (`collectives.exposed_links`). Counts are floats: extrapolated like the bytes."""
  flops: float
  bytes: float
  link_bytes: float = 0.0
  link_ops: float = 0.0
  link_hops: float = 0.0
  exposed_bytes: float = 0.0
  exposed_ops: float = 0.0
  exposed_hops: float = 0.0

  def __add__(self, other: "Cost") -> "Cost":
    return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

  def scaled(self, k: float) -> "Cost":
    return Cost(*(a * k for a in dataclasses.astuple(self)))

  def times(self, chip: ChipSpec) -> dict[str, float]:
    link = lambda nbytes, hops: ((nbytes / chip.link_bytes_per_s if chip.link_bytes_per_s else 0.0)
                                 + hops * chip.hop_latency_s)
    return {"compute": self.flops / chip.flops_per_s, "memory": self.bytes / chip.bytes_per_s,
            "collectives": link(self.link_bytes, self.link_hops),
            "exposed": link(self.exposed_bytes, self.exposed_hops)}

  def seconds(self, chip: ChipSpec, collectives: bool = False) -> float:
    """The roofline: the larger of FLOP time and memory time (and link time, if asked)."""
    t = self.times(chip)
    return max(t["compute"], t["memory"], t["collectives"] if collectives else 0.0)

  def forecast(self, chip: ChipSpec, flops_fraction: float, memory_fraction: float) -> float:
    """FLOP and memory time at the achievable fractions of the peaks, the larger of them and the
    overlapped collectives' link time, plus the exposed collectives' link time."""
    t = self.times(chip)
    return max(t["compute"] / flops_fraction, t["memory"] / memory_fraction,
               t["collectives"] - t["exposed"]) + t["exposed"]

  def bound(self, chip: ChipSpec, collectives: bool = False) -> str:
    t = self.times(chip)
    t.pop("exposed")
    if not collectives:
      t.pop("collectives")
    return max(t, key=t.get)


def extrapolate(at: dict[float, Cost], x: float) -> Cost:
  """The line through the costs at two points, at `x` (the one cost if only one point is given)."""
  if len(at) == 1:
    return next(iter(at.values()))
  (x0, c0), (x1, c1) = sorted(at.items())
  t = (x - x0) / (x1 - x0)
  return c0 + (c1 + c0.scaled(-1)).scaled(t)


@contextlib.contextmanager
def unrolled_loops():
  """`jax.lax.scan` / `map` / `fori_loop` unrolled while tracing, so the compiled cost counts every
  iteration, and a `while_loop` (the decode's) traced as one iteration of its body: XLA's cost of a
  while op also counts its whole carry (params, cache) in and out, which one step does not move.
  The model, the sampler and the update call them through `jax.lax`."""
  scan, fori = jax.lax.scan, jax.lax.fori_loop

  def unrolled_scan(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):
    return scan(f, init, xs, length=length, reverse=reverse, unroll=True, **kw)

  def unrolled_map(f, xs, *, batch_size=None):
    return scan(lambda c, x: (c, f(x)), None, xs, unroll=True)[1]

  def unrolled_fori(lower, upper, body, init, *, unroll=None):
    return fori(lower, upper, body, init, unroll=True)

  def one_iteration(cond, body, init):  # the decode loop: one step, without the loop's carry
    del cond
    return body(init)

  saved = (jax.lax.scan, jax.lax.map, jax.lax.fori_loop, jax.lax.while_loop)
  # jax caches traces per function and argument shapes: a program traced before (with its loops)
  # would be reused here, and an unrolled one would leak out to later callers. Clear on both sides.
  jax.clear_caches()
  jax.lax.scan, jax.lax.map, jax.lax.fori_loop, jax.lax.while_loop = (
      unrolled_scan, unrolled_map, unrolled_fori, one_iteration)
  try:
    yield
  finally:
    jax.lax.scan, jax.lax.map, jax.lax.fori_loop, jax.lax.while_loop = saved
    jax.clear_caches()


# XLA:TPU splits a large sharded matmul into a loop over the devices' shards (a windowed einsum),
# which the cost analysis would count once: compile the plain all-gather / reduce-scatter instead
# (the same FLOPs and bytes, all in the open). Memory-space assignment prefetches operands from HBM
# into on-chip memory, and the cost analysis counts such a prefetch as a read, a write and the
# consumer's read again, 3x the HBM bytes it moves: compile without prefetches, so each operand is
# read once from HBM (the 72B's decode step on v5p-64: 254 MB a layer with them, 235 without, for a
# 219 MB weight shard and 1 MB of cache; with int8 weights 181 and 128 MB for 110 MB).
_TPU_COST_OPTIONS = {"xla_tpu_enable_windowed_einsum_for_all_gather": "false",
                     "xla_tpu_enable_windowed_einsum_for_reduce_scatter": "false",
                     "xla_msa_max_outstanding_prefetches": "0"}


def _float_loop(hlo_line: str) -> bool:
  """A while op carrying floating-point values. Loops of integers only are the random-bit rounds
  (threefry, a loop on CPU): a few hundred integer ops, left out of the count."""
  head = hlo_line.partition(" while(")
  return bool(head[1]) and any(t in head[0] for t in ("f32[", "bf16[", "f16[", "f64["))


def compiled_program(fn, args, mesh: Mesh, between_meshes: bool = False):
  """`fn` traced with unrolled loops and compiled on `mesh`'s devices, as the cost model reads it."""
  lowered, options, context = _lowered(fn, args, mesh, between_meshes)
  with context():
    return lowered.compile(compiler_options=options)


def _lowered(fn, args, mesh: Mesh, between_meshes: bool):
  # No ambient mesh for a program between two meshes (the reshard): their device orders differ,
  # which jit refuses beside a context mesh; its shardings name both.
  context = (lambda: contextlib.nullcontext()) if between_meshes else (lambda: jax.set_mesh(mesh))
  with context(), unrolled_loops():
    lowered = fn.lower(*args)
  on_tpu = mesh.devices.flat[0].platform == "tpu"
  return lowered, (_TPU_COST_OPTIONS if on_tpu else None), context


def compiled_cost(fn, args, mesh: Mesh, between_meshes: bool = False,
                  cache: CostCache | None = None) -> Cost:
  """XLA's cost analysis of `compiled_program(fn, args, mesh)`, from `cache` if it holds the
  program's fingerprint (`aot.cost_cache`). A loop left in the compiled program is an error: its
  cost would count one iteration."""
  lowered, options, context = _lowered(fn, args, mesh, between_meshes)
  key = cache and fingerprint(lowered.as_text(), options, mesh.devices.flat)
  stored = cache.get(key) if cache else None
  if stored is not None:
    return Cost(**stored)
  with context():
    compiled = lowered.compile(compiler_options=options)
  text = compiled.as_text()
  if any(_float_loop(line) for line in text.splitlines()):
    raise ValueError("a compiled program of the step-time model still has a loop; its cost would "
                     "count one iteration")
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  links = collective_links(text, mesh.devices.size).values()
  exposed = exposed_links(text, mesh.devices.size)
  cost = Cost(float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0)),
              sum(k.bytes for k in links), sum(k.ops for k in links), sum(k.hops for k in links),
              exposed.bytes, exposed.ops, exposed.hops)
  if cache:
    cache.put(key, dataclasses.asdict(cost))
  return cost


def _depths(layers: int) -> tuple[int, ...]:
  """Layer counts to compile at: 3 and 4, or the real one. Fewer layers have compiled differently:
  with on-chip prefetches counted, the 72B simulator's decode step on v5p-64 (4x1x8) gave 25 MB
  from 2 to 3 layers and 288 MB from 3 to 4 for 219 MB of weights a layer; without them (now) it
  costs 1,033 / 1,268 / 1,503 / 1,738 MB a device at 2 / 3 / 4 / 5 layers, 235 MB a layer."""
  return (layers,) if layers <= 4 else (3, 4)


def depth_line(at: dict[int, Cost], layers: int, layer_bytes: float = 0.0) -> tuple[Cost, bool]:
  """(the cost at `layers` on the line through the costs at two depths, whether its bytes a layer
  were raised to `layer_bytes`). XLA's bytes a layer vary with the depth compiled: the 7B policy's
  decode step on v5p-64 (8x1x4) adds 180 / 87 / 155 MB from 2 / 3 / 4 to one layer more, for a
  weight shard of 116.5 MB a layer, so the line through 3 and 4 read fewer bytes a step than the
  chip's weight shard. A layer adds at least its weight shard and the cache it reads: `layer_bytes`."""
  if len(at) == 1:
    return next(iter(at.values())), False
  (d0, c0), (d1, c1) = sorted(at.items())
  per_layer = (c1 + c0.scaled(-1)).scaled(1 / (d1 - d0))
  raised = per_layer.bytes < layer_bytes
  if raised:
    per_layer = dataclasses.replace(per_layer, bytes=layer_bytes)
  return c1 + per_layer.scaled(layers - d1), raised


class CostModel:
  """Per-call costs of one run's programs, each on its model's mesh (`aot.layouts.Layouts`:
  sampler calls in their decode layouts, update and scoring passes on the training mesh), compiled
  on demand and kept.

  `rows` are the sampler programs' cache rows (default: the rollout's, `programs.rollout_rows`:
  every dialogue of a step, or `rollout.rows` of them, padded to the role's batch shards);
  `draft`: the simulator's draft (role "simulator_draft", on `layouts.draft`);
  `compile_cost` is swappable so tests can count compiles.
  """

  def __init__(self, spec: RunSpec, layouts: Layouts, *,
               layout: str = ap.TPU_CACHE_LAYOUT, rows: int | None = None,
               compile_cost: Callable = compiled_cost, cache: CostCache | None = None,
               log: Callable[[str], None] = lambda _: None, draft: Draft | None = None):
    self.spec, self.layouts, self.layout, self.log = spec, layouts, layout, log
    self.draft = draft
    self.mesh = layouts.train
    self._rows = rows
    self.compile_cost = compile_cost
    self.cache = cache
    self._kept: dict[tuple, Cost] = {}
    self._layer_bytes: dict[str, tuple[float, float]] = {}
    self.raised: set[tuple] = set()   # sampler calls whose bytes a layer `depth_line` raised
    self.compiles = 0

  def rows(self, role: str) -> int:
    return self._rows or ap.rollout_rows(self.spec, self.layouts.for_role(role))

  def _cost(self, key: tuple, build: Callable[[], tuple], mesh: Mesh) -> Cost:
    if key not in self._kept:
      fn, args = build()
      kw = {"cache": self.cache} if self.cache is not None else {}
      if key[0] == "reshard":
        kw["between_meshes"] = True
      self._kept[key] = self.compile_cost(fn, args, mesh, **kw)
      self.compiles += 1
      self.log(f"compiled {key}: {self._kept[key]}")
    return self._kept[key]

  def _role(self, role: str):
    """(model, rows, max_len, max_new) of a sampler role: "policy", "simulator" or its draft."""
    if role != "simulator_draft":
      return ap._sampler_role(self.spec, role)
    if self.draft is None:
      raise ValueError("the calls price a simulator draft, but no draft is given (--draft_preset)")
    s = self.spec.simulator
    return self.draft.model, None, s.max_context, s.max_new_tokens

  def _shape(self, role: str, layers: int) -> cp.SamplerShape:
    model, _, max_len, max_new = self._role(role)
    return cp.SamplerShape(cp.with_layers(model, layers), self.rows(role), max_len, max_new, self.layout)

  def _layers(self, role: str) -> int:
    if role == "policy":
      return ap.model_config(ap.policy_model(self.spec)).num_layers
    return ap.model_config(self._role(role)[0]).num_layers

  def sampler_call(self, role: str, kind: str, tokens: int | None, window: int) -> Cost:
    """One append chunk of `tokens` (kind "append"), one decode step ("decode"), one verify pass
    of k + 1 positions ("verify") or one step of the simulator's draft ("draft") at `window`."""
    if kind == "draft":
      role = "simulator_draft"
    max_len = self._role(role)[2]
    windows = window_buckets(max_len)
    ends = (windows[0], windows[-1]) if len(windows) > 1 else (windows[0],)
    L = self._layers(role)
    mesh = self.layouts.for_role(role)
    if kind == "verify":
      tokens = self.spec.simulator.draft_tokens + 1

    def at(layers: int, w: int) -> Cost:
      shape = self._shape(role, layers)
      build = {"decode": lambda: cp.decode_call(shape, w, mesh),
               "verify": lambda: cp.verify_call(shape, tokens - 1, w, mesh),
               "draft": lambda: cp.draft_step_call(shape, w, mesh),
               "append": lambda: cp.append_call(shape, tokens, w, mesh)}[kind]
      return self._cost((role, kind, tokens, w, layers), build, mesh)

    by_window = {}
    for w in ends:
      by_window[w], raised = depth_line({d: at(d, w) for d in _depths(L)}, L,
                                        self.layer_bytes(role, w))
      if raised:
        self.raised.add((role, kind, tokens, w))
    return extrapolate(by_window, window)

  def layer_bytes(self, role: str, window: int) -> float:
    """The least one layer adds to a sampler call on a device: its weight shard, and the keys
    and values of the device's cache rows through `window` slots."""
    if role not in self._layer_bytes:
      model, _, max_len, _ = self._role(role)
      mesh = self.layouts.for_role(role)
      def held(layers: int) -> tuple[int, int]:
        m = cp.with_layers(model, layers)
        cache = ap.abstract_cache(ap.model_config(m), self.rows(role), max_len, ap.cache_dtype(m),
                                  mesh, self.layout)
        return (plan_bytes(ap.abstract_params(m, mesh)[1]), plan_bytes(cache))
      (w1, k1), (w2, k2) = held(1), held(2)
      self._layer_bytes[role] = (w2 - w1, (k2 - k1) / max_len)
    weights, per_slot = self._layer_bytes[role]
    return weights + per_slot * window

  def decode_bytes_line(self, role: str) -> tuple[float, float]:
    """(bytes a decode step reads whatever its window, bytes per window slot) per device, at the
    model's depth: the line through the decode step's cost at the smallest and largest window."""
    windows = window_buckets((self.spec.policy if role == "policy" else self.spec.simulator)
                             .max_context)
    w0, w1 = windows[0], windows[-1]
    b0, b1 = (self.sampler_call(role, "decode", None, w).bytes for w in (w0, w1))
    slope = (b1 - b0) / (w1 - w0) if w1 > w0 else 0.0
    return b0 - slope * w0, slope

  def update_micro_batch(self, rows: int, length: int, critic: bool = False) -> Cost:
    L = self._layers("policy")
    return extrapolate({d: self._cost(("update", critic, rows, length, d), lambda d=d: cp.update_call(
        self.spec, self.mesh, rows=rows, length=length, critic=critic, layers=d), self.mesh)
        for d in _depths(L)}, L)

  def forward_micro_batch(self, rows: int, length: int) -> Cost:
    L = self._layers("policy")
    return extrapolate({d: self._cost(("forward", rows, length, d), lambda d=d: cp.forward_call(
        self.spec, self.mesh, rows=rows, length=length, layers=d), self.mesh) for d in _depths(L)}, L)

  def reshard(self) -> Cost:
    """The policy's decode copy refreshed from the training params (`programs.reshard_program`)."""
    L = self._layers("policy")
    return extrapolate({d: self._cost(("reshard", d), lambda d=d: cp.reshard_call(
        self.spec, self.layouts.train, self.layouts.policy, layers=d), self.mesh)
        for d in _depths(L)}, L)


@dataclasses.dataclass
class PhaseTime:
  """A phase's summed cost, roofline seconds (without and with the collectives' link time), the
  forecast's seconds (`Cost.forecast`), and how many of the roofline's each bound took."""
  calls: float = 0.0
  cost: Cost = Cost(0.0, 0.0)
  seconds: float = 0.0
  seconds_with_links: float = 0.0
  forecast: float = 0.0
  by_bound: dict = dataclasses.field(default_factory=dict)

  def add(self, cost: Cost, n: float, chip: ChipSpec,
          fractions: tuple[float, float] = (1.0, 1.0)) -> None:
    """`n` calls of `cost`; `fractions`: of peak FLOP/s and of HBM bandwidth, for the forecast."""
    self.calls += n
    self.cost = self.cost + cost.scaled(n)
    s = cost.seconds(chip) * n
    self.seconds += s
    self.seconds_with_links += cost.seconds(chip, collectives=True) * n
    self.forecast += cost.forecast(chip, *fractions) * n
    self.by_bound[cost.bound(chip)] = self.by_bound.get(cost.bound(chip), 0.0) + s

  @property
  def bound(self) -> str:
    if not self.seconds:
      return "-"
    name = max(self.by_bound, key=self.by_bound.get)
    return f"{name} ({self.by_bound[name] / self.seconds:.0%} of its time)"


def estimate(model: CostModel, calls: Calls, chip: ChipSpec, only: tuple[str, ...] = PHASES,
             fractions: tuple[float, float] = (1.0, 1.0)) -> dict[str, PhaseTime]:
  """Seconds per phase of the step whose program calls are `calls`; phases not in `only` are left
  out (each program compiles for minutes on a CPU machine), decodes first. `fractions` (of peak
  FLOP/s, of HBM bandwidth) price the forecast."""
  phases = {p: PhaseTime() for p in PHASES if p in only}

  def add(phase: str, cost: Cost, n: float) -> None:
    if phase in ("update", "reshard"):
      # The real compile overlaps the training mesh's all-gathers and reduce-scatters with its
      # matmuls (windowed einsums, which `_TPU_COST_OPTIONS` turns off to count them): none exposed.
      cost = dataclasses.replace(cost, exposed_bytes=0.0, exposed_ops=0.0, exposed_hops=0.0)
    phases[phase].add(cost, n, chip, fractions)

  for role, kind, tokens, window, n in sorted(sampler_keys(calls), key=lambda k: k[1] == "append"):
    phase = f"{role} decode" if kind != "append" else "prefills"
    if phase in phases:
      add(phase, model.sampler_call(role, kind, tokens, window), n)
  micro = calls.get("update/micro_batches", 0.0)
  if micro and "update" in phases:
    rows, length = int(calls["update/rows"]), int(calls["update/length"])
    add("update", model.update_micro_batch(rows, length), micro)
    if model.spec.algo == "ppo":
      add("update", model.update_micro_batch(rows, length, critic=True), micro)
    add("update", model.forward_micro_batch(rows, length), calls.get("forward/micro_batches", 0.0))
  if model.layouts.policy_copy and "reshard" in phases:  # once per step, after the update
    add("reshard", model.reshard(), 1)
  return phases


def forecast_from(phases: dict[str, PhaseTime], other: dict[str, PhaseTime]) -> None:
  """Each phase's forecast replaced by `other`'s: the roofline of one call layout (a bound at
  full budgets) beside the forecast of another (the lengths a real run uses)."""
  for name, p in phases.items():
    p.forecast = other[name].forecast
