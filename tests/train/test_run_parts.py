"""A run's parts are assembled in one place (`build.assemble`) and the Trainer receives them:
given parts, it loads nothing more and trains exactly as a Trainer that assembles its own."""
import jax
import numpy as np
import pytest

import tiny_world
from rlver_jax import build
from rlver_jax.spec import RunSpec
from rlver_jax.train.trainer import start_trainer


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


def test_a_trainer_given_parts_loads_nothing_and_steps_like_one_that_assembles(
    world, tmp_path, monkeypatch):
  spec = RunSpec.from_config(tiny_world.training_config(world, "ppo", total_steps=1))
  own = start_trainer(spec, str(tmp_path / "own"))
  parts = build.assemble(spec)
  assert parts.critic is not None and set(parts.layouts) == {"train", "policy_rollout", "simulator"}

  monkeypatch.setattr(build, "load_pretrained",
                      lambda *a, **k: pytest.fail("the Trainer loaded a model it was given"))
  given = start_trainer(spec, str(tmp_path / "given"), parts)
  assert given.policy is parts.policy and given.critic is parts.critic
  assert given.sampler is parts.sampler and given.backend is parts.backend
  assert given.layouts == own.layouts

  m_own, m_given = own.train_step().metrics, given.train_step().metrics
  assert m_given["reward_mean"] == m_own["reward_mean"]
  for key in ("policy", "critic"):
    for a, b in zip(jax.tree.leaves(getattr(own.state, key)), jax.tree.leaves(getattr(given.state, key))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
