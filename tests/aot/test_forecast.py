"""The forecast beside the roofline (`aot.forecast`): exposed link time and achievable fractions by
hand, the training mesh's collectives taken as overlapped, and the costs outside the programs."""
import dataclasses

import jax
import pytest

from rlver_jax.aot import forecast, step_time
from rlver_jax.aot.chips import CHIPS
from rlver_jax.aot.step_time import Cost, PhaseTime
from test_step_time import _LINKED, _POLICY_AND_COUNTS, _FixedCosts, _spec


def test_forecast_adds_exposed_link_time_at_stated_fractions_by_hand():
  """Half the all-reduces of the step above exposed: their 1.125 ms add to the HBM time at 44%
  (2.273 ms), which the other half's 1.125 ms overlaps."""
  step = Cost(0, 2.765e9, link_bytes=6e6, link_ops=160, link_hops=2240, exposed_bytes=3e6,
              exposed_ops=80, exposed_hops=1120)
  v5p = CHIPS["v5p"]
  exposed = 3e6 / 600e9 + 1120e-6
  assert step.times(v5p)["exposed"] == pytest.approx(exposed)
  assert step.forecast(v5p, 0.5, 0.44) == pytest.approx(1e-3 / 0.44 + exposed)
  # Compute-bound: 2 ms of FLOPs at 50% = 4 ms, more than the overlapped link time.
  assert Cost(918e9, 0).forecast(v5p, 0.5, 0.44) == pytest.approx(4e-3)
  # At full fractions and nothing exposed the forecast is the roofline with link time.
  plain = dataclasses.replace(step, exposed_bytes=0, exposed_ops=0, exposed_hops=0)
  assert plain.forecast(v5p, 1, 1) == pytest.approx(plain.seconds(v5p, collectives=True))
  p = PhaseTime()
  p.add(step, 1000, v5p, fractions=(0.5, 0.44))
  assert p.forecast == pytest.approx(1000 * (1e-3 / 0.44 + exposed))
  table = forecast.format_estimate({"policy decode": p, "update": PhaseTime()}, v5p, {}, "h",
                                   extra=[forecast.Extra("host round trips", 0.5, "by hand")])
  assert ("| policy decode | - | 1,000 | 0.000 | 2765.00 | 6.00 | 160,000 (80,000) | 1.000 | "
          "memory (100% of its time) | 2.250 | 3.398 |") in table and "1 us per ring step" in table
  assert "| host round trips | 0.500 | by hand |" in table
  assert ("step (estimated phases only): roofline 1.0 s (a bound), with link time 2.2 s (a bound); "
          "forecast 3.9 s (programs 3.4 s + outside them 0.5 s)") in table
  assert "memory time / 0.44" in table and "FLOP time / 0.5" in table
  with pytest.raises(ValueError, match=r"--memory_fraction=0: must be in \(0, 1\]"):
    forecast.Assumptions(memory_fraction=0)


class _ExposedCosts(_FixedCosts):
  """Every call: 3 s of HBM, 2 s of link time, half of it exposed (at 1 GB/s of both)."""
  cost = Cost(0, 3e9, link_bytes=2e9, link_ops=2, exposed_bytes=1e9, exposed_ops=1)

  def sampler_call(self, role, kind, tokens, window):
    return self.cost

  def update_micro_batch(self, rows, length, critic=False):
    return self.cost

  def reshard(self):
    return self.cost


def test_the_training_meshs_collectives_count_as_overlapped_in_the_forecast():
  calls = {"policy/decode_steps/W64": 1, "update/micro_batches": 1, "update/rows": 1,
           "update/length": 1, "forward/micro_batches": 0}
  phases = step_time.estimate(_ExposedCosts(), calls, _LINKED)
  assert phases["policy decode"].forecast == pytest.approx(3 + 1)   # the exposed second adds
  assert phases["update"].forecast == pytest.approx(2 * 3)          # PPO: policy and critic, hidden
  assert phases["reshard"].forecast == pytest.approx(3)
  assert phases["update"].seconds_with_links == pytest.approx(2 * 3)


def test_costs_outside_the_programs_by_hand():
  """grpo_think:runlocal (2 dialogues, the 7B policy, a save every 2 steps, no evaluation) on the 8
  fake CPU devices, the counts of `_POLICY_AND_COUNTS` and a 10 s simulator decode forecast."""
  from rlver_jax.aot.report import run_layouts
  spec = _spec()
  layouts = run_layouts(spec, jax.devices())
  sim = PhaseTime()
  sim.forecast = 10.0
  a = forecast.Assumptions(parse_failure_rate=0.1)
  out = {e.name: e for e in forecast.extras(spec, _POLICY_AND_COUNTS, {"simulator decode": sim},
                                            layouts, a, recorded=False)}
  assert set(out) == {"parse retries", "host round trips", "checkpoint save"}
  assert out["parse retries"].seconds == pytest.approx((1 - 0.9 ** 2) * 10.0)   # 2 rows a round
  assert out["host round trips"].seconds == pytest.approx(6 * 0.010 + 6 * 0.100)
  # fp32 params + Adam's two moments of the 7B's 7,615,616,512 weights, 12 bytes each, off 8
  # chips at 5 GB/s, every 2 steps.
  saved = 12 * 7_615_616_512
  assert forecast.state_bytes(spec, layouts) == pytest.approx(saved, rel=1e-6)
  assert out["checkpoint save"].seconds == pytest.approx(saved / (8 * 5e9) / 2, rel=1e-6)
  recorded = {e.name: e for e in forecast.extras(spec, {}, {}, layouts, a, recorded=True)}
  assert recorded["parse retries"].seconds == 0.0
  assert "4 text round trips (2 x simulator.max_turns)" in recorded["host round trips"].how
