"""Invariants that catch a miscount: a decode step priced by the step-time model reads at least
the chip's weight shard (all but the token embedding's table, of which a step reads one row a
cache row) plus the keys and values of the cache slots it attends, on the tiny model (extrapolated
from 3 and 4 layers) and on the 7B and 72B presets at the paper's rows on v5p-64 (libtpu), and
there less than 1.25x that."""
import dataclasses
import importlib.util
import runpy

import pytest

if importlib.util.find_spec("libtpu") is None:
  pytest.skip('libtpu is not installed (pip install "jax[tpu]==0.12.0.1")', allow_module_level=True)

from flax import nnx  # noqa: E402

import test_aot  # noqa: E402
from rlver_jax.aot import call_programs as cp  # noqa: E402
from rlver_jax.aot import programs as ap  # noqa: E402
from rlver_jax.aot import step_time  # noqa: E402
from rlver_jax.aot import target as aot_target  # noqa: E402
from rlver_jax.aot.plan import per_device_bytes  # noqa: E402
from rlver_jax.aot.report import run_layouts  # noqa: E402
from rlver_jax.aot.step_time import Cost, depth_line  # noqa: E402
from rlver_jax.aot.topology import get_topology, hbm_per_device  # noqa: E402
from rlver_jax.models import presets  # noqa: E402
from rlver_jax.sampling.sampler import window_buckets  # noqa: E402


def test_a_layer_adds_at_least_its_floor_by_hand():
  at = {3: Cost(30, 1000), 4: Cost(40, 1087)}       # 87 bytes a layer, as XLA counted them
  assert depth_line(at, 28, 0.0) == (Cost(280, 1087 + 24 * 87), False)
  assert depth_line(at, 28, 116.5) == (Cost(280, 1087 + 24 * 116.5), True)   # raised to the floor
  assert depth_line({2: Cost(1, 5)}, 2, 99.0) == (Cost(1, 5), False)          # compiled whole


def _least_bytes(spec, layouts, role: str, window: int, rows: int) -> float:
  """Per device: its weight shard but the embedding table, and its cache rows' k and v through
  `window` slots, from the abstract arrays' shardings (no compiling)."""
  model, _, max_len, _ = ap._sampler_role(spec, role)
  mesh = layouts.for_role(role)
  _, params = ap.abstract_params(model, mesh)
  flat = dict(nnx.to_flat_state(params))
  weights = per_device_bytes(params)
  if not ap.model_config(model).tie_word_embeddings:
    weights -= per_device_bytes(flat[("embed",)])
  cache = ap.abstract_cache(ap.model_config(model), rows, max_len, ap.cache_dtype(model), mesh)
  return weights + per_device_bytes(cache) * window / max_len


def _check_decode_bytes(spec, topology: str, roles=("policy", "simulator")) -> dict[str, float]:
  devices = get_topology(topology)
  layouts = run_layouts(spec, devices, None, hbm_per_device(devices))
  model = step_time.CostModel(spec, layouts)
  ratios = {}
  for role in roles:
    section = spec.policy if role == "policy" else spec.simulator
    for w in window_buckets(section.max_context):
      priced = model.sampler_call(role, "decode", None, w).bytes
      least = _least_bytes(spec, layouts, role, w, model.rows(role))
      assert priced >= least, (role, w, priced, least)
      ratios[f"{role}/W{w}"] = priced / least
  return ratios


def test_the_tiny_models_decode_reads_its_weight_shard_and_cache(monkeypatch):
  monkeypatch.setitem(presets.PRESETS, "aot-test-tiny", test_aot._TINY)
  config = test_aot._tiny_run()
  config.policy.preset = "aot-test-tiny:6"      # extrapolated from 3 and 4 layers
  config.simulator.preset = "aot-test-tiny:5"
  config.simulator.max_context = 64             # one window: the simulator compiles once a depth
  ratios = _check_decode_bytes(aot_target.from_config(config), "v5p:2x2x1")
  assert set(ratios) == {"policy/W64", "policy/W128", "policy/W256", "simulator/W64"}


def test_the_7b_and_72b_decode_steps_read_their_weight_shards_on_v5p_64():
  """The paper's grpo_think (128 rows; the 7B policy 8x1x4, the 72B simulator 4x1x8, in bf16 and
  with int8 weights) with 64-slot caches, so each step compiles at one window: before a layer was
  held to its floor, the 7B's step priced 3.25 GB a chip against a 3.54 GB weight shard."""
  config = runpy.run_path(str(test_aot._REPO / "configs" / "grpo_think.py"))["get_config"](None)
  config.policy.max_context = config.simulator.max_context = 64
  ratios = _check_decode_bytes(aot_target.from_config(config), "v5p:2x4x4")
  assert set(ratios) == {"policy/W64", "simulator/W64"}
  # An overcount: a step priced with its weights in their stored layouts pays the relayout that the
  # compiled loop makes once a call (the 72B's q, k and v projections: 1.31x), or its on-chip
  # prefetches three times over (1.16x); without both 1.08x (the 7B 1.10x).
  assert max(ratios.values()) < 1.25, ratios
  # int8 weights (a byte each, a scale per output channel): counted with its prefetches, the step
  # priced ~156 MB a layer against a ~110 MB shard; now 1.18x, 2 MB a layer over bf16's excess.
  config.simulator.weight_dtype = "int8"
  int8 = _check_decode_bytes(aot_target.from_config(config), "v5p:2x4x4", roles=("simulator",))
  assert int8["simulator/W64"] < 1.25, int8


def test_an_int8_decode_step_costs_its_window_not_its_cache_length():
  """The 72B's decode step on v5p-64 (4x1x8) with an int8 cache, at a 64-slot window, 3 layers, in
  caches of 4k and 8k slots: the same bytes. Traced with the cache's scales in their stored layout,
  the step paid a relayout of the whole scale buffers (31 MB more at 8k slots), which the compiled
  loop does once a call."""
  config = runpy.run_path(str(test_aot._REPO / "configs" / "grpo_think.py"))["get_config"](None)
  config.simulator.kv_dtype = "int8"
  spec = aot_target.from_config(config)
  devices = get_topology("v5p:2x4x4")
  layouts = run_layouts(spec, devices, None, hbm_per_device(devices))
  model = step_time.CostModel(spec, layouts)
  mesh = layouts.for_role("simulator")
  costs = []
  for max_len in (4096, 8192):
    shape = dataclasses.replace(model._shape("simulator", 3), max_len=max_len)
    costs.append(step_time.compiled_cost(*cp.decode_call(shape, 64, mesh), mesh).bytes)
  assert costs[0] == costs[1], costs
