"""The step-time model: roofline arithmetic against hand numbers, loop counting in XLA's cost,
lockstep and continuous-batching call layouts against hand traces, and the CLI on the smallest TPU slice (libtpu)."""
import importlib.util
import json
import pathlib
import runpy
import types

import jax
import jax.numpy as jnp
import pytest
from absl import flags
from absl.testing import flagsaver

from rlver_jax.aot import step_calls, step_time, step_time_cli
from rlver_jax.aot import target as aot_target
from rlver_jax.aot.chips import CHIPS, ChipSpec, chip_for_kind
from rlver_jax.aot.step_time import Cost, PhaseTime, extrapolate

_REPO = pathlib.Path(__file__).resolve().parents[2]
_CHIP = ChipSpec("test", flops_per_s=1e12, bytes_per_s=1e9)
_LINKED = ChipSpec("test", flops_per_s=1e12, bytes_per_s=1e9, link_bytes_per_s=1e9)


def _config(name="grpo_think", arg="runlocal"):
  return runpy.run_path(str(_REPO / "configs" / f"{name}.py"))["get_config"](arg)


def _spec(name="grpo_think", arg="runlocal", **sections):
  """The run spec of a config, with `sections` = {"policy": {key: value}} overriding it."""
  config = _config(name, arg)
  for section, values in sections.items():
    for key, value in values.items():
      setattr(getattr(config, section), key, value)
  return aot_target.from_config(config)


def test_roofline_seconds_by_hand():
  assert Cost(2e12, 1e9).seconds(_CHIP) == pytest.approx(2.0)      # 2 s of FLOPs > 1 s of bytes
  assert Cost(2e12, 1e9).bound(_CHIP) == "compute"
  assert Cost(1e12, 3e9).seconds(_CHIP) == pytest.approx(3.0)      # 1 s of FLOPs < 3 s of bytes
  assert Cost(1e12, 3e9).bound(_CHIP) == "memory"
  assert Cost(1e12, 3e9, 5e9).seconds(_LINKED) == pytest.approx(3.0)   # the roofline leaves links out
  assert Cost(1e12, 3e9, 5e9).seconds(_LINKED, collectives=True) == pytest.approx(5.0)
  assert Cost(1e12, 3e9, 5e9).bound(_LINKED, collectives=True) == "collectives"
  # v5p: 459 TFLOP/s, 2,765 GB/s: a 7B bf16 weight read (15.2 GB) takes 5.5 ms.
  assert Cost(0, 15.2e9).seconds(CHIPS["v5p"]) == pytest.approx(15.2 / 2765, rel=1e-9)
  assert chip_for_kind("TPU v5") is CHIPS["v5p"] and chip_for_kind("TPU v5 lite") is CHIPS["v5e"]
  with pytest.raises(ValueError, match="no peak FLOP/s or bandwidth known for device kind 'z80'"):
    chip_for_kind("z80")
  with pytest.raises(ValueError, match="must be > 0"):
    ChipSpec("bad", 0, 1)


def test_phase_sums_and_dominant_bound_by_hand():
  p = PhaseTime()
  p.add(Cost(1e12, 3e9), 2, _CHIP)    # 2 calls x 3 s, memory-bound
  p.add(Cost(4e12, 1e9), 1, _CHIP)    # 1 call x 4 s, compute-bound
  p.add(Cost(0, 0, 8e9), 1, _LINKED)  # 8 GB over a 1 GB/s link: only in the column with link time
  assert p.calls == 4 and p.seconds == pytest.approx(10.0) and p.by_bound["memory"] == pytest.approx(6.0)
  assert p.seconds_with_links == pytest.approx(18.0)
  assert p.cost == Cost(6e12, 7e9, 8e9) and p.bound == "memory (60% of its time)"


def test_link_time_adds_every_ring_step_latency_by_hand():
  """A tensor-parallel decode step: 160 small all-reduces over 8 devices (2 x 7 ring steps each)."""
  step = Cost(0, 2.765e9, link_bytes=6e6, link_ops=160, link_hops=160 * 14)
  v5p = CHIPS["v5p"]
  assert v5p.hop_latency_s == 1e-6 and v5p.link_bytes_per_s == 600e9
  link = 6e6 / 600e9 + 160 * 14 * 1e-6                     # 10 us of bytes + 2.24 ms of latency
  assert step.times(v5p)["collectives"] == pytest.approx(link)
  assert step.seconds(v5p) == pytest.approx(1e-3)           # the roofline: 1 ms of HBM
  assert step.seconds(v5p, collectives=True) == pytest.approx(link)
  # Counts add, scale and extrapolate like the bytes: 2 layers at 100 steps, 3 at 150 -> 28 at 1,400.
  assert extrapolate({2: Cost(0, 0, 0, 10, 100), 3: Cost(0, 0, 0, 15, 150)}, 28) == Cost(0, 0, 0, 140, 1400)
  p = PhaseTime()
  p.add(step, 1000, v5p)
  assert p.cost.link_ops == 160_000 and p.seconds_with_links == pytest.approx(1000 * link)


def test_link_time_of_a_gpu_counts_bytes_only():
  step = Cost(0, 2.765e9, link_bytes=6e6, link_ops=160, link_hops=160 * 14)
  assert CHIPS["h100"].hop_latency_s == 0   # none known: the bytes alone
  assert step.times(CHIPS["h100"])["collectives"] == pytest.approx(6e6 / 900e9)


def test_extrapolation_to_depth_and_window_by_hand():
  at = {2: Cost(10, 100), 3: Cost(13, 150)}   # 3 FLOPs and 50 bytes a layer over 4 and 0 outside
  assert extrapolate(at, 28) == Cost(10 + 26 * 3, 100 + 26 * 50)
  assert extrapolate({64: Cost(0, 64), 1024: Cost(0, 1024)}, 512) == Cost(0, 512)
  assert extrapolate({5: Cost(1, 2)}, 99) == Cost(1, 2)


class _FixedCosts:
  """A CostModel stand-in with one cost per program kind (no compiling)."""
  spec = _spec("ppo_think")

  def sampler_call(self, role, kind, tokens, window):
    return Cost(0, window * (1e6 if kind == "decode" else 1e3 * tokens))

  def update_micro_batch(self, rows, length, critic=False):
    return Cost(rows * length * (2e9 if critic else 1e9), 0)

  def forward_micro_batch(self, rows, length):
    return Cost(rows * length * 1e8, 0)

  layouts = types.SimpleNamespace(policy_copy=True)   # a serving layout: a reshard per step

  def reshard(self):
    return Cost(0, 5e8)


def test_estimate_multiplies_costs_by_calls_by_hand():
  calls = {"policy/decode_steps/W64": 10, "policy/decode_steps/W128": 5, "simulator/decode_steps/W256": 2,
           "policy/prefill/T256/W64": 1, "simulator/append/T64/W512": 3, "policy/prefill_calls": 1,
           "policy/decode_calls": 2, "update/micro_batches": 4, "update/rows": 2, "update/length": 100,
           "forward/micro_batches": 6}
  phases = step_time.estimate(_FixedCosts(), calls, _CHIP)
  assert phases["policy decode"].seconds == pytest.approx((10 * 64e6 + 5 * 128e6) / 1e9)
  assert phases["simulator decode"].seconds == pytest.approx(2 * 256e6 / 1e9)
  assert phases["prefills"].seconds == pytest.approx((64 * 256e3 + 3 * 512 * 64e3) / 1e9)
  # PPO: the policy's and the critic's update per micro-batch, then the scoring passes.
  assert phases["update"].seconds == pytest.approx((4 * 200 * 3e9 + 6 * 200 * 1e8) / 1e12)
  assert phases["prefills"].calls == 4 and phases["update"].bound.startswith("compute")
  assert phases["reshard"].calls == 1 and phases["reshard"].seconds == pytest.approx(0.5)
  # --phases leaves the others out (their programs are not compiled).
  only = step_time.estimate(_FixedCosts(), calls, _CHIP, only=("reshard",))
  assert list(only) == ["reshard"] and only["reshard"].seconds == pytest.approx(0.5)


def _scan_matmuls(x, ws):
  return jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]


def test_unrolled_loops_count_every_iteration_on_cpu():
  mesh = jax.sharding.Mesh(jax.devices("cpu")[:1], ("x",))
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  flops = {}
  for L in (1, 4):
    ws = jax.ShapeDtypeStruct((L, 128, 128), jnp.float32)
    flops[L] = step_time.compiled_cost(jax.jit(_scan_matmuls), (x, ws), mesh).flops
    plain = jax.jit(_scan_matmuls).lower(x, ws).compile().cost_analysis()
    plain = plain[0] if isinstance(plain, (list, tuple)) else plain
    assert plain["flops"] == pytest.approx(2 * 8 * 128 * 128, rel=1e-3)  # XLA alone: the body once, any L
  one = 2 * 8 * 128 * 128
  assert flops == {1: pytest.approx(one, rel=1e-3), 4: pytest.approx(4 * one, rel=1e-3)}

  def loop(x, w):  # a while loop costs one iteration of its body, not its trip count
    return jax.lax.while_loop(lambda s: s[1] < 5, lambda s: (s[0] @ w, s[1] + 1), (x, 0))[0]
  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  assert step_time.compiled_cost(jax.jit(loop), (x, w), mesh).flops == pytest.approx(one, rel=1e-3)
  assert jax.lax.scan is not None and jax.lax.scan.__name__ == "scan"  # restored afterwards

  # A program traced before with its loop (jax caches the trace) is traced again unrolled, and the
  # unrolled trace does not leak to later callers.
  looped, ws = jax.jit(_scan_matmuls), jax.ShapeDtypeStruct((3, 128, 128), jnp.float32)
  with jax.set_mesh(mesh):  # the same context as compiled_cost's: part of the cache's key
    assert " while(" in looped.lower(x, ws).compile().as_text()
  assert step_time.compiled_cost(looped, (x, ws), mesh).flops == pytest.approx(3 * one, rel=1e-3)
  with jax.set_mesh(mesh):
    assert " while(" in looped.lower(x, ws).compile().as_text()


_LENGTHS = step_calls.StatedLengths(turns=2, policy_tokens=32, reply_tokens=20, user_tokens=30,
                                    simulator_tokens=40, policy_prompt=100, simulator_prompt=120,
                                    instruction_tokens=30)
# Both flows' policy side and counts: one decode segment a turn, 4 simulator answers (the opening,
# 2 emotion steps, the reply of turn 1), 2 policy turns + 4 answers through the host as text.
_POLICY_AND_COUNTS = {
    "policy/prefill/T256/W64": 1,       # 100 prompt tokens into an empty cache
    "policy/decode_steps/W256": 64,     # 32 steps from 100 (window 132 -> 256), then from 151
    "policy/append/T64/W128": 1,        # rewound to 100: reply 20 + <|im_end|> + user 30 = 51
    # Filled slots summed over decode steps (the floor's KV): 32 steps from 100 and from 151
    # (32 x 100 + 528, 32 x 151 + 528); a row's most: 151 + 32.
    "policy/decode_slots": 3728 + 5360, "policy/peak_slots": 183, "policy/decode_calls": 2,
    "simulator/decode_calls": 4, "simulator/answer_rounds": 4, "host/text_round_trips": 6,
    # 2 dialogues x 2 turns = 4 samples of <= 183 tokens -> length 192; 2 mini-batches of 2 rows.
    "update/micro_batches": 2, "update/rows": 2, "update/length": 192, "forward/micro_batches": 2}


def test_stated_calls_follow_the_lockstep_rollout_by_hand():
  """grpo_think:runlocal (policy cache 1k, windows 64..1024; simulator 3k), thoughts dropped, the
  'chat' flow: every simulator answer stays in its cache."""
  lengths = _LENGTHS
  calls = step_calls.stated_calls(_spec(simulator=dict(info_flow="chat")), lengths)
  assert calls == {
      **_POLICY_AND_COUNTS,
      "simulator/append/T128/W64": 1,     # its first prompt
      "simulator/decode_steps/W256": 80,  # the opening (120 -> 160), turn 1's emotion (210 -> 250)
      "simulator/append/T64/W256": 2,     # turn 1: reply + emotion instruction at 160, reply instr. at 250
      "simulator/decode_steps/W512": 80,  # turn 1's reply (280 -> 320), turn 2's emotion (370 -> 410)
      "simulator/append/T64/W512": 1,     # turn 2: reply + emotion instruction at 320
      # 40 steps from 120, 210, 280, 370 (40 x start + 820 each).
      "simulator/decode_slots": 5620 + 9220 + 12020 + 15620, "simulator/peak_slots": 410}
  with pytest.raises(ValueError, match="--turns=0: must be >= 1"):
    step_calls.StatedLengths(0, 1, 1, 1, 1, 1, 1, 1)


def test_the_reference_flow_rewinds_each_answer_by_hand():
  """'reference': after each answer the cache goes back to the transcript (the prompt, then per
  turn the user's line and the quoted reply); the next request is appended there."""
  calls = step_calls.stated_calls(_spec(simulator=dict(info_flow="reference")), _LENGTHS)
  assert calls == {
      **_POLICY_AND_COUNTS,
      "simulator/append/T128/W64": 1,     # the first prompt, 120
      # The opening 120 -> 160; rewound to 120, turn 1's line 30 + reply 20 + request 30 appended
      # (T128 at 120), the emotion step 200 -> 240; rewound to 170, the reply request (T64 at 170),
      # the reply 200 -> 240; rewound to 170, turn 2's 80 tokens (T128 at 170), 250 -> 290.
      "simulator/append/T128/W128": 1, "simulator/append/T64/W256": 1,
      "simulator/append/T128/W256": 1,
      "simulator/decode_steps/W256": 120, "simulator/decode_steps/W512": 40,
      "simulator/decode_slots": 5620 + 8820 + 8820 + 10820, "simulator/peak_slots": 290}
  chat = step_calls.stated_calls(_spec(simulator=dict(info_flow="chat")), _LENGTHS)
  assert calls["simulator/decode_slots"] < chat["simulator/decode_slots"]


def test_stated_calls_follow_decode_segments_by_hand():
  """Policy decodes in segments of 16 tokens, windows past 128 in steps of 128 (`Sampler.decode`)."""
  lengths = step_calls.StatedLengths(turns=2, policy_tokens=32, reply_tokens=20, user_tokens=30,
                                     simulator_tokens=40, policy_prompt=100, simulator_prompt=120,
                                     instruction_tokens=30)
  whole = step_calls.stated_calls(_spec(), lengths)
  calls = step_calls.stated_calls(_spec(policy=dict(decode_segment=16, window_step=128)), lengths)
  # From 100: 16 steps reaching 116 (window 128), 16 reaching 132 (256); from 151: 167, 183 (256).
  assert calls["policy/decode_steps/W128"] == 16 and calls["policy/decode_steps/W256"] == 48
  assert whole["policy/decode_steps/W256"] == 64 and "policy/decode_steps/W128" not in whole
  # Two segments a turn: 4 host round trips, not 2. Nothing else moves: the same filled slots (the
  # floor), appends and simulator calls.
  assert calls["policy/decode_calls"] == 4 and whole["policy/decode_calls"] == 2
  same = lambda c: {k: n for k, n in c.items() if not k.startswith(("policy/decode_steps",
                                                                    "policy/decode_calls"))}
  assert same(calls) == same(whole)


def test_stated_calls_follow_continuous_batching_by_hand():
  """6 dialogues (3 groups of 2) on 4 rows: 2 groups at once, all of one length, so their rows free
  up together and the third group runs alone after them: every sampler call twice (at 4 rows)."""
  lengths = step_calls.StatedLengths(2, 32, 20, 30, 40, 100, 120, 30)
  spec = _spec(rl=dict(profiles_per_step=3))
  lockstep = step_calls.stated_calls(spec, lengths)
  assert lockstep["policy/prefill/T256/W64"] == 1 and step_calls.waves(spec) == 1
  for rows, waves in ((4, 2), (5, 2), (2, 3), (6, 1)):  # 5: a group never splits, 1 row idles
    spec = aot_target.with_rollout_rows(spec, rows)
    assert step_calls.waves(spec) == waves
    calls = step_calls.stated_calls(spec, lengths)
    for key, n in lockstep.items():
      once = key.startswith(("update/", "forward/")) or key.endswith("/peak_slots")  # a row's most
      assert calls[key] == (n if once else waves * n), key
  assert set(calls) == set(lockstep)
  # The layout word of the estimate's header.
  assert step_time_cli.layout_word(spec) == "continuous, 6 rows"
  assert step_time_cli.layout_word(aot_target.with_rollout_rows(spec, 0)) == "lockstep"


def test_calls_from_metrics_reads_a_step_and_names_a_bad_file(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": 1, "calls/policy/decode_steps/W64": 3.0, "rollout_seconds": 2.0},
          {"step": 2, "calls/policy/decode_steps/W64": 5.0, "rollout_seconds": 1.0, "update_seconds": 1.5}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert step_calls.calls_from_metrics(str(path)) == (
      {"policy/decode_steps/W64": 5.0}, {"rollout_seconds": 1.0, "update_seconds": 1.5, "step": 2.0})
  assert step_calls.calls_from_metrics(str(path), 1)[0] == {"policy/decode_steps/W64": 3.0}
  with pytest.raises(ValueError, match=r"--calls_from=.*: no calls/\* metrics in step 7"):
    step_calls.calls_from_metrics(str(path), 7)
  with pytest.raises(ValueError, match="--calls_from=/nonexistent: cannot read"):
    step_calls.calls_from_metrics("/nonexistent")


# -- the command line on the smallest TPU slice -----------------------------------------------------

_needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                   reason='libtpu is not installed (pip install "jax[tpu]==0.12.0.1")')


@pytest.fixture
def tiny_run_config(monkeypatch):
  """test_aot's tiny run config: a 2-layer policy and a 1-layer simulator on 256-slot caches."""
  from rlver_jax.models import presets
  import test_aot  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(presets.PRESETS, "aot-test-tiny", test_aot._TINY)
  return test_aot._tiny_run()


@_needs_libtpu
def test_cli_estimates_a_tiny_run_on_one_v5e_chip(tiny_run_config, tmp_path, capsys):
  from rlver_jax.aot import cli
  flags.FLAGS.mark_as_parsed()
  metrics = tmp_path / "metrics.jsonl"
  metrics.write_text(json.dumps({"step": 3, "rollout_seconds": 0.5, "update_seconds": 0.25,
                                 "calls/policy/decode_steps/W256": 10.0,
                                 "calls/update/micro_batches": 2.0, "calls/update/rows": 2.0,
                                 "calls/update/length": 128.0, "calls/forward/micro_batches": 2.0}) + "\n")
  cache = tmp_path / "costs"
  runs = []
  for _ in range(2):   # the second run reads every cost from the cache, compiling nothing
    with flagsaver.flagsaver(estimate_time=True, topology="v5e:1x1", calls_from=f"{metrics}:3",
                             cost_cache=str(cache)):
      cli._run(tiny_run_config)
    runs.append(capsys.readouterr().out)
  out = runs[0]
  assert ("step-time model on v5e:1x1 (train 1x1x1, policy decode 1x1x1 (decode copy), simulator decode "
          "1x1x1 (data x fsdp x tensor); cache rows policy 2, simulator 2, lockstep; "
          "simulator.info_flow 'reference')") in out
  # decode at 2 windows, the update, the log-prob pass, the reshard
  assert f"(step 3); 5 programs costed; cost cache {cache}: 0 hits, 5 compiled" in out
  assert f"(step 3); 5 programs costed; cost cache {cache}: 5 hits, 0 compiled" in runs[1]
  assert len(list(cache.glob("*.json"))) == 5
  same = lambda text: text.split("\n", 1)[1]   # all but the header
  assert same(runs[0]) == same(runs[1])
  assert "| policy decode | 1x1x1 | 10 |" in out and "| simulator decode | 1x1x1 | 0 |" in out
  assert "| reshard | 1x1x1 -> 1x1x1 | 1 |" in out
  # A recorded step has no filled-slot counts: the floor takes the attended windows, and says so.
  assert "floor, policy decode: " in out and "(slots: attended windows, an upper bound)" in out
  assert "measured: rollout 0.50 s, update 0.25 s" in out and "TPU v5e at 197 TFLOP/s" in out
  # The forecast beside the roofline, and what it assumed.
  assert "roofline s (a bound)" in out and "| forecast s |" in out and "(a bound); forecast" in out
  assert "| parse retries | 0.000 | in the recorded calls already |" in out
  assert "memory time / 0.44" in out and "time to first step: 4 programs compiled x 20 s" in out
  # --rows is checked like config.rollout.rows (a group of 2 starts together).
  from rlver_jax.aot.topology import AotError
  with flagsaver.flagsaver(estimate_time=True, topology="v5e:1x1", rows=1):
    with pytest.raises(AotError, match=r"config.rollout.rows=1: must be 0 \(lockstep\) or in"):
      cli._run(tiny_run_config)
