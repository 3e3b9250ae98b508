"""The co-located simulator with int8 weights and/or KV (config simulator.weight_dtype / kv_dtype),
built as the trainer builds it, against the unquantized one: greedy turns on the tiny world."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiny_world import make_world
from rlver_jax import build
from rlver_jax.env.profiles import load_profiles
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.spec import SimulatorSpec



@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return make_world(tmp_path_factory.mktemp("world"))


def _turns(world, weight_dtype, kv_dtype):
  """Two dialogues, opening and one step with fixed policy replies, greedy: every simulator token."""
  spec = SimulatorSpec(checkpoint=world["policy"], dtype="float32", max_context=512, max_new_tokens=8,
                       temperature=0.0, append_buckets=(64, 256), weight_dtype=weight_dtype,
                       kv_dtype=kv_dtype)
  backend = build.simulator_backend(spec, None, seed=0)
  profiles = load_profiles(world["profiles"])[:2]
  users = SimulatedUsers.playing(profiles, backend, dataclasses.replace(spec.user_rules(), max_turns=3))
  users.opening()
  users.step(users.live_rows(), ["try a plan", "hello you"][:len(users.live_rows())])
  return backend, [list(t) for t in backend.tokens]


def test_int8_simulator_turns_match_the_unquantized_ones(world):
  # Weights and KV together; each alone is compared at the model and cache level
  # (tests/models/test_int8_weights.py, tests/sampling/test_int8_kv.py).
  _, want = _turns(world, "bf16", "bf16")
  assert sum(map(len, want)) > 50
  got_backend, got = _turns(world, "int8", "int8")
  wq = dict(nnx.to_flat_state(got_backend.params))[("layers", "wq")].get_value()
  assert wq.dtype == jnp.int8 and got_backend.cache.k.dtype == jnp.int8
  same = np.mean([a == b for x, y in zip(want, got) for a, b in zip(x, y)])
  assert [len(t) for t in got] == [len(t) for t in want] and same == 1.0, same
