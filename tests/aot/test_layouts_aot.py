"""The step-time model and memory plan in per-model layouts, on 8 fake CPU devices and a tiny model:
a serving-layout decode step moves no weights (the FSDP one all-gathers them all), the reshard moves
what the two shardings say by hand, and the report names each phase's layout."""
import importlib.util
import re

import jax
import pytest

import test_aot
from rlver_jax.aot import layouts as aot_layouts
from rlver_jax.aot import plan as run_plan
from rlver_jax.aot import forecast, step_time
from rlver_jax.aot.target import from_config as _spec
from rlver_jax.aot.chips import CHIPS
from rlver_jax.aot.report import run_layouts
from rlver_jax.aot.topology import AotError
from rlver_jax.models import presets

_T = test_aot._TINY   # 2 layers, D 256, 4 q / 2 kv heads of 64, MLP 512, vocab 1024, untied


@pytest.fixture
def tiny(monkeypatch):
  monkeypatch.setitem(presets.PRESETS, "aot-test-tiny", _T)
  config = test_aot._tiny_run()   # runlocal: fp32 params and compute, so no cast in the reshard
  config.rl.profiles_per_step = 4   # 8 dialogues: one cache row per device
  return config


def _layer_weight_bytes() -> int:
  """One layer's fp32 matrices: q, o (D x H Dh), k, v (D x K Dh), gate, up, down (D x F)."""
  D, H, K, Dh, F = _T.hidden_size, _T.num_heads, _T.num_kv_heads, _T.head_dim, _T.intermediate_size
  return 4 * (2 * D * H * Dh + 2 * D * K * Dh + 3 * D * F)


def _split_bytes() -> int:
  """fp32 bytes of every weight with a hidden-size dimension (FSDP-sharded in training)."""
  return _T.num_layers * _layer_weight_bytes() + 4 * 2 * _T.vocab_size * _T.hidden_size


def _decode_link_bytes(config, policy_mesh: str) -> float:
  config.rollout.policy_mesh = policy_mesh
  config.policy.max_context = 64   # one window: one compile
  spec = _spec(config)
  layouts = run_layouts(spec, jax.devices())
  model = step_time.CostModel(spec, layouts)
  window = spec.policy.max_context
  return model.sampler_call("policy", "decode", None, window).link_bytes


def test_serving_decode_moves_no_layer_weights_while_fsdp_gathers_them_all(tiny):
  assert len(jax.devices()) == 8
  fsdp = _decode_link_bytes(tiny, "train")       # 1x8x1: every weight all-gathered every step
  serving = _decode_link_bytes(tiny, "auto")     # 4x1x2: activations all-reduced over 2 chips
  # Each device lacks 7/8 of every matrix but the token embedding (its rows are looked up in place).
  embedding = 4 * _T.vocab_size * _T.hidden_size
  assert fsdp >= 7 / 8 * (_split_bytes() - embedding)
  assert serving < 0.05 * _layer_weight_bytes()


def test_reshard_moves_what_the_shardings_say_by_hand(tiny):
  """Training 1x8x1 (weights split over their hidden dim) to decode layouts over the same 8 devices.
  Norms and q/k/v biases are whole on every device in both: nothing to move."""
  tiny.mesh.fsdp = 8
  for policy_mesh, share in (("8x1x1", 7 / 8),     # replicated: each device lacks 7 of 8 row blocks
                             ("4x1x2", 7 / 16)):   # half the columns, of which it held 1/8 of rows
    tiny.rollout.policy_mesh = policy_mesh
    layouts = run_layouts(_spec(tiny), jax.devices())
    cost = step_time.CostModel(_spec(tiny), layouts).reshard()
    assert cost.link_bytes == pytest.approx(share * _split_bytes()), policy_mesh
  tiny.rollout.policy_mesh = "train"   # no copy: nothing resharded, no phase
  layouts = run_layouts(_spec(tiny), jax.devices())
  assert not layouts.policy_copy and "policy_reshard" not in run_plan.update_programs(_spec(tiny))


def test_the_estimate_names_each_phases_layout(tiny):
  tiny.rollout.policy_mesh = "auto"
  tiny.simulator.mesh = "2x2x2"
  layouts = run_layouts(_spec(tiny), jax.devices())
  assert layouts.describe() == ("train 1x8x1, policy decode 4x1x2 (decode copy), simulator decode "
                                "2x2x2 (data x fsdp x tensor)")
  table = forecast.format_estimate({p: step_time.PhaseTime() for p in step_time.PHASES},
                                    CHIPS["v5p"], {}, "h", forecast.phase_layouts(layouts))
  for row in ("| policy decode | 4x1x2 |", "| simulator decode | 2x2x2 |",
              "| prefills | policy 4x1x2, simulator 2x2x2 |", "| update | 1x8x1 |",
              "| reshard | 1x8x1 -> 4x1x2 |"):
    assert row in table
  tiny.simulator.mesh = "1x1x8"   # 2 kv heads: refused, naming the key
  with pytest.raises(AotError, match=r"config\.simulator\.mesh='1x1x8': tensor=8 does not divide"):
    run_layouts(_spec(tiny), jax.devices())


def test_resident_state_puts_each_model_on_its_mesh(tiny):
  """The plan's per-device bytes: training state split 8 ways, the decode copy and the simulator
  split only over their tensor axis (2), each KV cache over rows x kv heads (8)."""
  tiny.simulator.mesh = "auto"
  tiny.rollout.policy_mesh = "auto"
  spec = _spec(tiny)
  layouts = run_layouts(spec, jax.devices())
  state = run_plan.resident_state(spec, layouts)
  whole = aot_layouts.weight_bytes(aot_layouts.ap.policy_model(spec))
  assert state["update"]["policy decode copy"] == pytest.approx(whole / 2, rel=0.02)
  assert state["update"]["policy params"] == pytest.approx(whole / 8, rel=0.02)
  assert set(state["rollout"]) - set(state["update"]) == {"policy KV cache"}
  # 8 rows of 256 slots, 2 kv heads of 64, k and v, fp32, 2 layers; one row and one head a device.
  kv = 2 * _T.num_layers * 8 * 256 * _T.num_kv_heads * _T.head_dim * 4
  assert state["rollout"]["policy KV cache"] == pytest.approx(kv / 8, rel=0.01)


_needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                   reason='libtpu is not installed (pip install "jax[tpu]==0.12.0.1")')


@_needs_libtpu
def test_a_resident_tp8_simulator_costs_13_gib_more_per_chip_than_fsdp_on_v5p_64():
  """grpo_think's 72B simulator on 32 chips (no compiling): TP8 x DP4 holds 1/8 of it per chip,
  FSDP 1/32; the difference is 3/32 of its ~145 GB of bf16 weights."""
  from rlver_jax.aot.topology import get_topology, hbm_per_device
  config = test_aot._RUN_CONFIGS["grpo_think"]()
  devices = get_topology("v5p:2x4x4")
  sims = {}
  for value in ("auto", "train"):
    with config.unlocked():
      config.simulator.mesh = value
    spec = _spec(config)
    layouts = run_layouts(spec, devices, None, hbm_per_device(devices))
    sims[value] = run_plan.resident_state(spec, layouts)["update"]["simulator params"]
  assert layouts.shape("simulator") == "1x32x1"
  whole = aot_layouts.weight_bytes(aot_layouts.ap.simulator_model(spec))
  assert sims["auto"] - sims["train"] == pytest.approx(whole * (1 / 8 - 1 / 32), rel=0.01)
  assert 12.5 < (sims["auto"] - sims["train"]) / 2**30 < 13.5


def test_the_decode_floor_counts_an_int8_cache_in_int8_bytes_plus_its_scales(tiny):
  """Hand-computed per slot and row, every layer: k and v of each kv head, in the cache's dtype
  (fp32 under runlocal), and in int8 with one fp32 scale per token and kv head."""
  from rlver_jax.aot import floor, programs as ap
  c = ap.model_config(ap.simulator_model(_spec(tiny)))   # runlocal's simulator: 1 of the 2 layers
  L, K, Dh = c.num_layers, _T.num_kv_heads, _T.head_dim
  assert (c.num_kv_heads, c.head_dim) == (K, Dh)
  assert floor.kv_bytes_per_slot(ap.simulator_model(_spec(tiny))) == 2 * L * K * Dh * 4
  tiny.simulator.kv_dtype = "int8"
  assert floor.kv_bytes_per_slot(ap.simulator_model(_spec(tiny))) == 2 * L * K * (Dh + 4)


@pytest.fixture
def tiny_bf16(monkeypatch):
  """grpo_think's own dtypes (bf16 compute and cache) on the tiny preset, a 1,024-slot policy cache."""
  monkeypatch.setitem(presets.PRESETS, "aot-test-tiny", _T)
  config = test_aot._RUN_CONFIGS["grpo_think"]()
  with config.unlocked():
    config.policy.preset, config.simulator.preset = "aot-test-tiny", "aot-test-tiny:1"
    config.policy.max_context, config.simulator.max_context = 1024, 256
    config.mesh.fsdp = 8
  return config


def _window_copies(config, policy_mesh: str, window: int) -> list[str]:
  """Instructions of the compiled TPU decode step (v5p, 8 chips) that hold a layer's KV window,
  [.., window, .., head_dim], as an array of their own rather than reading the cache in place."""
  from rlver_jax.aot import call_programs as cp
  from rlver_jax.aot.topology import get_topology
  with config.unlocked():
    config.rollout.policy_mesh = policy_mesh
  spec = _spec(config)
  layouts = run_layouts(spec, get_topology("v5p:2x2x2"))
  mesh = layouts.for_role("policy")
  fn, args = cp.decode_call(step_time.CostModel(spec, layouts)._shape("policy", _T.num_layers),
                            window, mesh)
  text = step_time.compiled_program(fn, args, mesh).as_text()
  entry = text[text.index("\nENTRY"):].splitlines()[1:]
  shape = re.compile(r"= \w+\[([\d,]+)\]")
  copies = []
  for line in entry:
    dims = shape.search(line)
    dims = [int(d) for d in dims.group(1).split(",")] if dims else []
    if window in dims and dims[-1] == _T.head_dim and "parameter(" not in line:
      copies.append(line.strip()[:120])
  return copies


@_needs_libtpu
def test_serving_decode_reads_the_kv_window_in_place_on_tpu(tiny_bf16):
  """The paper's serving layouts hold one kv head a chip (7B: 4 heads over tensor 4; 72B: 8 over 8).
  There XLA:TPU feeds the cache itself to the attention dots (the window's dynamic slice fused in):
  no window-sized array is made. Two kv heads a chip (the FSDP layout, 1x8x1) copy each layer's k and
  v window to a new layout first, which shows that the check sees such a copy."""
  assert _window_copies(tiny_bf16, "auto", 512) == []   # 4x1x2: one kv head a chip
  copies = _window_copies(tiny_bf16, "train", 512)
  assert sum(" copy(" in c for c in copies) == 2 * _T.num_layers, copies   # k and v, each layer


@pytest.mark.parametrize("policy_mesh, simulator_mesh, weight_dtype, hbm_gib, topology, expected", [
    ("auto", "auto", "bf16", None, None, ("2x1x4", "1x1x8")),
    ("auto", "auto", "int8", 16, None, ("1x2x4", "1x1x8")),   # the fp32 7B's shard crowds 16 GiB
    ("-1x1x2", "train", "bf16", None, None, ("4x1x2", "1x8x1")),   # the training mesh itself
    ("2x1x4", "1x2x4", "bf16", None, None, ("2x1x4", "1x2x4")),
    # runlocal's fp32 72B crowds a 95 GiB chip at tensor 8: FSDP 2 as well
    pytest.param("auto", "auto", "bf16", 95, "v5p:2x4x4", ("8x1x4", "2x2x8"), marks=_needs_libtpu),
])
def test_the_plans_meshes_are_the_meshes_the_trainer_builds(monkeypatch, policy_mesh, simulator_mesh,
                                                            weight_dtype, hbm_gib, topology,
                                                            expected):
  """`build.decode_mesh` (the trainer's, over `build.mesh_from`) and `aot.layouts.resolve` (the
  plan's) give equal meshes: the same sizes and the same device order, for each model of
  grpo_think:runlocal (the 7B and 72B presets) on the 8 fake CPU devices, and on v5p-64, where a mesh
  of each shape would otherwise pick its own physical order (`make_mesh`)."""
  from rlver_jax import build
  from rlver_jax.models.presets import param_dtype_of
  from rlver_jax.aot import programs as ap
  config = test_aot._RUN_CONFIGS["grpo_think"]("runlocal")
  config.rollout.policy_mesh, config.simulator.mesh = policy_mesh, simulator_mesh
  config.simulator.weight_dtype = weight_dtype
  spec = _spec(config)
  hbm = hbm_gib and hbm_gib * 2**30
  monkeypatch.setattr(build, "_hbm_bytes", lambda: hbm)
  devices = jax.devices()
  if topology:   # the trainer's jax.devices() on that slice
    from rlver_jax.aot.topology import get_topology
    devices = get_topology(topology)
    monkeypatch.setattr(jax, "devices", lambda *_: devices)
  # The trainer reads the simulator's architecture from its checkpoint; here, the preset's.
  monkeypatch.setattr(build, "simulator_config", lambda sim: ap.model_config(ap.simulator_model(spec)))
  plan = run_layouts(spec, devices, None, hbm)
  mesh = build.mesh_from(spec.mesh)
  policy, _ = build.decode_mesh(spec.rollout.policy_mesh, "rollout.policy_mesh",
                                ap.model_config(ap.policy_model(spec)), spec.mesh, mesh,
                                param_dtype_of(spec.policy.compute_dtype), "policy rollout")
  simulator, _ = build.simulator_mesh(spec.simulator, spec.mesh, mesh)
  assert (plan.train, plan.policy, plan.simulator) == (mesh, policy, simulator)
  assert [d.id for d in plan.simulator.devices.flat] == [d.id for d in simulator.devices.flat]
  assert (plan.shape("policy"), plan.shape("simulator")) == expected
