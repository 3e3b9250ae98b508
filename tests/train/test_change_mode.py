"""A real GRPO training step with simulator.change_mode="expected" against the co-located model
simulator (its answers forced, so every analysis has a readable change line): the rewards are the
final emotion / 100 with unrounded expected changes, and they reach metrics, transcripts and the
end-of-run summary."""
import json
import math

import pytest

import forced_simulator
import tiny_world
from rlver_jax import build
from rlver_jax.train import loop as train
from rlver_jax.spec import RunSpec
from rlver_jax.train.summary import late_excerpt


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  root = tmp_path_factory.mktemp("world")
  return dict(tiny_world.make_world(root), simulator=forced_simulator.make_simulator(root))


def test_grpo_step_with_expected_changes(world, tmp_path, monkeypatch):
  real = build.simulator_backend

  def forced(*args, **kwargs):
    backend = real(*args, **kwargs)
    forced_simulator.force_answers(backend)
    return backend

  monkeypatch.setattr(build, "simulator_backend", forced)
  config = tiny_world.training_config(world, "grpo", total_steps=1, **{
      "simulator.backend": "model", "simulator.checkpoint": world["simulator"],
      "simulator.max_new_tokens": 16, "simulator.max_context": 2048, "simulator.dtype": "float32",
      "simulator.change_mode": "expected", "log.transcripts_every": 1,
      "rl.profiles_per_step": 2, "rl.group_size": 2})
  train.run(RunSpec.from_config(config), str(tmp_path))
  row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  assert row["parse_failures"] == 0
  assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
  (path,) = (tmp_path / "transcripts").glob("step_*.jsonl")
  dialogues = [json.loads(l) for l in path.read_text().splitlines()]
  assert len(dialogues) == 4
  for d in dialogues:
    changes = [t["change"] for t in d["turns"] if t["change"] is not None]
    assert len(changes) == 2 and all(-10 <= c <= 10 and c != round(c) for c in changes)
    assert d["final_emotion"] == pytest.approx(30 + sum(changes))
    assert d["reward"] == pytest.approx(d["final_emotion"] / 100)
  rewards = [d["reward"] for d in dialogues]
  assert row["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
  assert row["reward_std"] > 0  # other policy replies, other expected changes: a GRPO signal
  assert any("[change +" in line or "[change -" in line
             for line in late_excerpt(str(tmp_path / "transcripts")))
