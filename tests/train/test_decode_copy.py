"""The trainer's models in their own layouts on the 8 fake devices: the policy's rollout reads a bf16
decode copy in rollout.policy_mesh that equals the trained weights cast after every update and
after a resume; the co-located simulator lives on simulator.mesh; the layouts are named in the
workdir."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny_world


@pytest.fixture(scope="module")
def world(tmp_path_factory):  # 4 q / 2 kv heads: 'auto' is tensor parallel (2) on 8 devices
  return tiny_world.make_world(tmp_path_factory.mktemp("world"), num_heads=4, num_kv_heads=2)


def _config(world, **extra):
  return tiny_world.training_config(world, "grpo", **{
      "total_steps": 2, "policy.compute_dtype": "bfloat16", "simulator.backend": "model",
      "simulator.checkpoint": world["policy"], "simulator.dtype": "bfloat16",
      "simulator.max_new_tokens": 6, "simulator.max_context": 2048,
      "simulator.max_parse_retries": 0, "rl.profiles_per_step": 1, "rl.group_size": 2,
      # Moves every weight each update even where the group's rewards tie (zero advantages).
      "optim.weight_decay": 1.0, **extra})


def _check_copy(trainer) -> dict:
  """Asserts the decode copy is the master weights cast to bf16 (norm scales kept fp32, as the
  model reads them) on the rollout sampler's mesh; returns it as numpy by path."""
  copy = dict(nnx.to_flat_state(trainer.rollout_params))
  out = {}
  for path, var in nnx.to_flat_state(trainer.state.policy):
    master = np.asarray(var[...])
    assert master.dtype == np.float32
    want = master if str(path[-1]).endswith("norm") else master.astype(jnp.bfloat16)
    got = copy[path][...]
    assert got.sharding.mesh == trainer.sampler.mesh, path
    assert got.dtype == want.dtype, path
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))
    out[path] = np.asarray(got)
  return out


@pytest.mark.parametrize("policy_mesh, rollout_layout", [
    ("auto", "data=4 fsdp=1 tensor=2 (auto)"), ("train", "data=1 fsdp=8 tensor=1 (train)")])
def test_the_decode_copy_follows_every_update_and_a_resume(world, tmp_path, policy_mesh,
                                                           rollout_layout):
  config = _config(world, **{"rollout.policy_mesh": policy_mesh})
  trainer = tiny_world.trainer(config, str(tmp_path))
  assert trainer.layouts == {"train": "data=1 fsdp=8 tensor=1", "policy_rollout": rollout_layout,
                             "simulator": "data=4 fsdp=1 tensor=2 (auto)"}
  # The simulator was born on its own mesh and its cache rows are padded to its 4 row shards.
  sim = trainer.backend.sampler
  assert dict(sim.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
  assert {a.sharding.mesh for a in jax.tree.leaves(trainer.backend.params)} == {sim.mesh}
  assert sim.padded_rows(2) == 4
  moved = 0 if policy_mesh == "train" else sum(
      v[...].size * 2 for path, v in nnx.to_flat_state(trainer.state.policy)
      if not str(path[-1]).endswith("norm"))  # bf16; the norms are replicated in both layouts
  first = _check_copy(trainer)
  for _ in range(2):
    metrics = trainer.train_step().metrics
    copy = _check_copy(trainer)
    assert metrics["reshard/bytes"] == moved and np.isfinite(metrics["time/reshard"])
  assert any(not np.array_equal(first[p], copy[p]) for p in copy)  # the updates did move it
  trainer.save()
  trainer.checkpointer.close()

  resumed = tiny_world.trainer(config, str(tmp_path))
  assert resumed.restore_if_any() and resumed.step == 2
  again = _check_copy(resumed)
  for path, value in copy.items():
    np.testing.assert_array_equal(again[path], value)
  resumed.checkpointer.close()
  starts = json.loads((tmp_path / "provenance.json").read_text())
  assert [s["layouts"]["policy_rollout"] for s in starts] == [rollout_layout] * 2
