"""The suite's guard against the mapping limit frees compiled programs' mappings (tests/conftest.py)."""
import jax
import jax.numpy as jnp
import pytest

from memory_maps import memory_maps, release_compiled_programs_above


def test_released_programs_give_their_mappings_back():
  if memory_maps() is None:
    pytest.skip("no /proc/self/maps on this system")
  jax.jit(lambda x: x + 1)(jnp.ones(8)).block_until_ready()  # the runtime's own first-use mappings
  release_compiled_programs_above(0.0)
  before = memory_maps()[0]
  kept = [jax.jit(lambda x, k=k: jnp.tanh(x * k).sum()) for k in range(40)]
  for f in kept:
    f(jnp.ones(8)).block_until_ready()
  compiled = memory_maps()[0]
  assert compiled - before >= 40  # each executable holds mappings while its function lives
  assert not release_compiled_programs_above(1.0)  # below the threshold: nothing is cleared
  assert memory_maps()[0] >= compiled - 5
  assert release_compiled_programs_above(0.0)
  after = memory_maps()[0]
  assert compiled - after >= 0.8 * (compiled - before)  # the functions live on; their programs are gone
