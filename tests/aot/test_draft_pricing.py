"""Pricing a simulator draft and the forecast's lengths: the acceptance arithmetic, the call layout
with a draft against hand counts, costs times calls with fixed costs, the programs' routing to the
draft's model and mesh (traced on CPU, not compiled for TPU), the draft in the memory plan."""
import importlib.util
import json
import types

import jax
import pytest
from absl import flags
from absl.testing import flagsaver

from rlver_jax.aot import draft as aot_draft
from rlver_jax.aot import layouts as aot_layouts
from rlver_jax.aot import plan as run_plan
from rlver_jax.aot import step_calls, step_time, step_time_cli
from rlver_jax.aot import target as aot_target
from rlver_jax.aot.chips import ChipSpec
from rlver_jax.aot.step_time import Cost
from rlver_jax.models import presets
from rlver_jax.parallel.sharding import MeshConfig
from rlver_jax.spec.forward import ModelShape

from test_step_time import _LENGTHS, _spec

_CHIP = ChipSpec("test", flops_per_s=1e12, bytes_per_s=1e9)
_TAU = (1 - 0.6 ** 5) / 0.4   # k = 4, a = 0.6: 2.3056 tokens a verify pass


def _draft(a=0.6, k=4):
  return aot_draft.Draft(ModelShape("qwen2.5-0.5b"), k, a)


def test_tokens_per_pass_and_the_recorded_share_by_hand():
  assert aot_draft.tokens_per_pass(0.6, 4) == pytest.approx(1 + 0.6 + 0.36 + 0.216 + 0.1296)
  assert _draft().per_pass == pytest.approx(_TAU)
  assert aot_draft.tokens_per_pass(0.0, 4) == 1.0 and aot_draft.tokens_per_pass(1.0, 4) == 5.0
  # A run logs kept / proposed: at a = 0.6, k = 4, 1.3056 of 4 proposals.
  assert aot_draft.kept_share(0.6, 4) == pytest.approx(1.3056 / 4)
  for a in (0.0, 0.3, 0.6, 0.9, 1.0):
    assert aot_draft.acceptance_from_ratio(aot_draft.kept_share(a, 4), 4) == pytest.approx(a, abs=1e-9)
  with pytest.raises(ValueError, match="must be in"):
    aot_draft.acceptance_from_ratio(1.5, 4)
  with pytest.raises(ValueError, match="--draft_acceptance=1.2: must be in"):
    _draft(a=1.2)


def test_stated_calls_with_a_draft_by_hand():
  """The reference flow of test_step_time (4 answers of 40 tokens, reaching 160, 240, 240, 290):
  each answer is one call of 39 / tau + 1 passes and 4 x 39 / tau draft steps at its window."""
  spec = _spec(simulator=dict(info_flow="reference"))
  plain = step_calls.stated_calls(spec, _LENGTHS)
  calls = step_calls.stated_calls(spec, _LENGTHS, draft=_draft())
  per = 39 / _TAU + 1
  assert calls["simulator/verify_passes/W256"] == pytest.approx(3 * per)
  assert calls["simulator/verify_passes/W512"] == pytest.approx(per)
  assert calls["simulator/draft_steps/W256"] == pytest.approx(3 * 4 * 39 / _TAU)
  assert calls["simulator/draft_steps/W512"] == pytest.approx(4 * 39 / _TAU)
  assert calls["simulator/verify_calls"] == 4
  # The draft's cache takes every simulator append; nothing else moves.
  assert {k: n for k, n in calls.items() if k.startswith("simulator_draft/")} == {
      f"simulator_draft/{k.partition('/')[2]}": n for k, n in plain.items()
      if k.startswith(("simulator/append/", "simulator/prefill/"))}
  decodes = ("simulator/decode_", "simulator/verify_", "simulator/draft_steps", "simulator_draft/")
  kept = lambda c: {k: n for k, n in c.items() if not k.startswith(decodes)}
  assert kept(calls) == kept(plain)
  # A draft step reads k positions past the row's reach: 214 + 40 = 254 -> window 256, draft 512.
  out = {}
  cache = step_calls._Cache("simulator", spec.simulator, out, _draft())
  cache.length = 214
  cache.decode(40, 40)
  assert set(out) == {"simulator/verify_passes/W256", "simulator/draft_steps/W512",
                      "simulator/verify_calls"} and cache.length == 254
  # In decode segments of 16 (`SpeculativeSampler.decode`): 16, 16 and 8 tokens, each call with
  # its own closing pass and window; the last one's draft steps read past 256.
  out = {}
  cache = step_calls._Cache("simulator", _spec(simulator=dict(decode_segment=16)).simulator, out,
                            _draft())
  cache.length = 214
  cache.decode(40, 40)
  assert out == {"simulator/verify_passes/W256": pytest.approx(2 * (15 / _TAU + 1) + 7 / _TAU + 1),
                 "simulator/draft_steps/W256": pytest.approx(2 * 4 * 15 / _TAU),
                 "simulator/draft_steps/W512": pytest.approx(4 * 7 / _TAU),
                 "simulator/verify_calls": 3}


def test_recorded_decodes_turned_into_verify_passes_by_hand():
  calls = {"simulator/decode_steps/W256": 120.0, "simulator/decode_steps/W512": 40.0,
           "simulator/decode_calls": 4.0, "simulator/append/T64/W256": 1.0,
           "policy/decode_steps/W64": 5.0}
  out = step_calls.with_draft(calls, _draft())
  # 4 calls spread like their steps: 3 at W256, 1 at W512; a call of n steps: (n - 1) / tau + 1.
  assert out == {"simulator/verify_passes/W256": pytest.approx(117 / _TAU + 3),
                 "simulator/verify_passes/W512": pytest.approx(39 / _TAU + 1),
                 "simulator/draft_steps/W256": pytest.approx(4 * 117 / _TAU),
                 "simulator/draft_steps/W512": pytest.approx(4 * 39 / _TAU),
                 "simulator/verify_calls": 4.0, "simulator/append/T64/W256": 1.0,
                 "simulator_draft/append/T64/W256": 1.0, "policy/decode_steps/W64": 5.0}
  recorded = {"simulator/verify_passes/W256": 9.0, "simulator/draft_steps/W256": 32.0}
  assert step_calls.with_draft(recorded, _draft()) == recorded


class _FixedCosts:
  """Costs by kind (no compiling): a decode step 2 GB, a verify pass 3 GB, a draft step 0.1 GB, an
  append 1 MB a token."""
  spec = _spec()
  layouts = types.SimpleNamespace(policy_copy=False)

  def sampler_call(self, role, kind, tokens, window):
    return Cost(0, {"decode": 2e9, "verify": 3e9, "draft": 1e8}.get(kind, 1e6 * (tokens or 0)))


def test_the_simulator_decode_prices_verify_passes_and_draft_steps_by_hand():
  calls = {"simulator/verify_passes/W256": 10.0, "simulator/draft_steps/W256": 36.0,
           "simulator/verify_calls": 1.0, "simulator/append/T64/W256": 2.0,
           "simulator_draft/append/T64/W256": 2.0, "policy/decode_steps/W64": 4.0}
  phases = step_time.estimate(_FixedCosts(), calls, _CHIP)
  assert phases["simulator decode"].seconds == pytest.approx(10 * 3 + 36 * 0.1)
  assert phases["simulator decode"].calls == 46
  assert phases["prefills"].seconds == pytest.approx(4 * 64e6 / 1e9)   # both caches' appends
  assert phases["policy decode"].seconds == pytest.approx(8.0)
  # The forecast of other calls beside the bound's roofline (the mean lengths').
  mean = step_time.estimate(_FixedCosts(), {**calls, "policy/decode_steps/W64": 1.0}, _CHIP,
                            fractions=(1.0, 0.5))
  step_time.forecast_from(phases, mean)
  assert phases["policy decode"].seconds == pytest.approx(8.0)
  assert phases["policy decode"].forecast == pytest.approx(2 / 0.5)


def test_forecast_lengths_come_from_the_mean_flags_or_the_budget():
  flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(mean_policy_tokens=20):
    mean, note = step_time_cli.forecast_lengths(_LENGTHS)
  assert mean == step_calls.StatedLengths(2, 20, 20, 30, 40, 100, 120, 30)
  assert "policy 20 tokens a turn (--mean_policy_tokens)" in note
  assert ("simulator 40 tokens a turn (as stated, by default the budget: RLVER reports no mean "
          "simulator answer length)") in note
  assert step_time_cli.forecast_lengths(_LENGTHS)[0] == _LENGTHS


def test_the_draft_and_its_acceptance_come_from_the_checkpoint_flags_or_a_recorded_step(tmp_path):
  flags.FLAGS.mark_as_parsed()
  (tmp_path / "config.json").write_text(json.dumps(
      {**presets.to_hf_config(presets.get_preset("qwen2.5-0.5b")), "num_hidden_layers": 12}))
  spec = _spec(simulator=dict(draft_checkpoint=str(tmp_path), decode_segment=0))
  model, source = aot_draft.draft_shape(spec, None)
  assert model.preset == "qwen2.5-0.5b:12" and "config.json (matched to a preset)" in source
  assert aot_draft.draft_shape(_spec(), None) is None
  assert aot_draft.draft_shape(_spec(), "qwen2.5-1.5b")[0].preset == "qwen2.5-1.5b"
  remote = _spec(simulator=dict(draft_checkpoint="gs://b/draft", decode_segment=0))
  with pytest.raises(ValueError, match="no config.json readable here; name its architecture"):
    aot_draft.draft_shape(remote, None)
  found = aot_draft.draft_shape(remote, "qwen2.5-0.5b")
  assert "gs://b/draft not readable here" in found[1]
  # Acceptance: the flag, else the recorded kept share (turned into a per-token a), else the default.
  recorded = {"simulator/draft_acceptance": aot_draft.kept_share(0.7, 4)}
  assert step_time_cli._draft(spec, found, recorded).acceptance == pytest.approx(0.7)
  assert step_time_cli._draft(spec, found, {}).acceptance == aot_draft.DEFAULT_ACCEPTANCE
  with flagsaver.flagsaver(draft_acceptance=0.5):
    assert step_time_cli._draft(spec, found, recorded).acceptance == 0.5
    with pytest.raises(Exception, match="--draft_acceptance: no draft to price"):
      step_time_cli._draft(_spec(), None, {})


def _tiny(draft_mesh):
  import test_aot  # pylint: disable=import-outside-toplevel
  config = test_aot._tiny_run()
  config.simulator.mesh = "2x1x2"
  config.simulator.draft_mesh = draft_mesh
  return aot_target.from_config(config)


@pytest.fixture
def tiny_preset(monkeypatch):
  import test_aot  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(presets.PRESETS, "aot-test-tiny", test_aot._TINY)


def test_verify_and_draft_programs_trace_on_their_models_and_meshes(tiny_preset):
  """A CostModel whose compile traces what it is given and records it: verify passes on the
  simulator's mesh and model with k + 1 positions a row, draft steps on the draft's (2 layers
  against the simulator's 1), two positions a row."""
  spec = _tiny("4x1x1")
  draft = aot_draft.Draft(ModelShape("aot-test-tiny", param_dtype="float32", dtype="float32"),
                          spec.simulator.draft_tokens, 0.6)
  layouts = aot_layouts.resolve(spec, jax.devices("cpu")[:4], MeshConfig(1, 4, 1), None,
                                draft=draft.model)
  assert layouts.shape("simulator") == "2x1x2" and layouts.shape("simulator_draft") == "4x1x1"
  seen = []

  def compile_cost(fn, args, mesh, **_):
    with jax.set_mesh(mesh):
      jax.eval_shape(fn, *args)   # traces the whole program
    seen.append((mesh, args[2].shape, sum(x.size for x in jax.tree.leaves(args[0]))))
    return Cost(1.0, float(args[2].shape[1]))

  model = step_time.CostModel(spec, layouts, compile_cost=compile_cost, draft=draft)
  k = spec.simulator.draft_tokens
  assert model.sampler_call("simulator", "verify", None, 256) == Cost(1.0, k + 1)
  assert {s[:2] for s in seen} == {(layouts.simulator, (model.rows("simulator"), k + 1))}
  simulator_params = seen[0][2]
  seen.clear()
  assert model.sampler_call("simulator", "draft", None, 256) == Cost(1.0, 2.0)
  assert {s[:2] for s in seen} == {(layouts.draft, (model.rows("simulator_draft"), 2))}
  assert seen[0][2] > simulator_params
  with pytest.raises(ValueError, match="no draft is given"):
    step_time.CostModel(spec, layouts, compile_cost=compile_cost).sampler_call(
        "simulator", "draft", None, 256)


def test_the_memory_plan_holds_the_draft(tiny_preset):
  """A draft of the simulator's own shape on the simulator's mesh: its params and cache cost what
  the simulator's do; without a draft, neither is there."""
  spec = _tiny("2x1x2")
  devices, train = jax.devices("cpu")[:4], MeshConfig(1, 4, 1)
  layouts = aot_layouts.resolve(spec, devices, train, None, draft=aot_layouts.ap.simulator_model(spec))
  state = run_plan.resident_state(spec, layouts)
  for phase in ("rollout", "update"):
    assert state[phase]["draft params"] == state[phase]["simulator params"] > 0
    assert state[phase]["draft KV cache"] == state[phase]["simulator KV cache"] > 0
  plain = run_plan.resident_state(spec, aot_layouts.resolve(spec, devices, train, None))
  assert "draft params" not in plain["rollout"] and "draft KV cache" not in plain["update"]


_needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                   reason='libtpu is not installed (pip install "jax[tpu]==0.12.0.1")')


@_needs_libtpu
def test_cli_prices_a_tiny_draft_on_four_v5e_chips(tiny_preset, capsys):
  """The tiny run with the tiny simulator as its own draft: the verify and draft programs compile
  for TPU (no loop left), and the table's notes say what was assumed."""
  import test_aot  # pylint: disable=import-outside-toplevel
  from rlver_jax.aot import cli  # pylint: disable=import-outside-toplevel
  flags.FLAGS.mark_as_parsed()
  config = test_aot._tiny_run()
  config.simulator.decode_segment = 0
  lengths = dict(turns=2, policy_tokens=16, reply_tokens=8, user_tokens=8, simulator_tokens=16,
                 policy_prompt=32, simulator_prompt=32, instruction_tokens=8)
  with flagsaver.flagsaver(estimate_time=True, topology="v5e:2x2", draft_preset="aot-test-tiny:1",
                           cost_cache="", phases=["simulator decode"], mean_simulator_tokens=10,
                           **lengths):
    cli._run(config)
  out = capsys.readouterr().out
  assert "simulator decode 2x1x2, draft decode 2x1x2 (data x fsdp x tensor)" in out
  assert "| simulator decode | 2x1x2 (draft 2x1x2) |" in out
  assert "floor, simulator decode: not computed for a draft-and-verify decode" in out
  # 4 answers of 16 tokens: 15 / 2.31 + 1 passes and 4 x 15 / 2.31 draft steps each.
  assert f"| simulator decode | 2x1x2 (draft 2x1x2) | {4 * (1 + 5 * 15 / _TAU):,.0f} |" in out
  assert "simulator 10 tokens a turn (--mean_simulator_tokens)" in out
  assert "draft: aot-test-tiny:1 from --draft_preset=aot-test-tiny:1; a = 0.600 (default" in out
  assert "k = 4 proposals a verify pass, 2.31 tokens a pass" in out
