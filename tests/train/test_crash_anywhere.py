"""SIGKILL at a random point of a step and during a checkpoint commit, then the
same command again: the run ends with the params of a straight run, bitwise, and metrics.jsonl
holds every step once with the same values. `crash_anywhere.py` is the longer version (10 kills)."""
import pytest

import crash_anywhere
import tiny_world
from rlver_jax.train import loop as train
from rlver_jax.spec import RunSpec


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


def test_sigkill_anywhere_then_the_same_command_equals_a_straight_run(world, tmp_path):
  landed = crash_anywhere.run_with_kills(world, tmp_path / "crashed", steps=2, kills=2, seed=0,
                                         step_s=3.0)
  assert len(landed) == 2  # one at a random time into a step, one during a checkpoint commit
  steps = max(r["step"] for r in crash_anywhere.metrics(tmp_path / "crashed"))
  cfg = tiny_world.training_config(world, "grpo", total_steps=steps, **{"checkpoint.every_steps": 1})
  train.run(RunSpec.from_config(cfg), str(tmp_path / "straight"))  # in-process: the same program as the CLI's
  crash_anywhere.compare(world, tmp_path / "straight", tmp_path / "crashed", steps)
