"""rl.policy_loss and rl.is_correction through the trainer on a real tiny-world rollout: each
correction's weights against a numpy recomputation from the batch, the loss variants' first update
against PPO's, and the mismatch/* metrics in metrics.jsonl and TensorBoard of every run."""
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tiny_world
from rlver_jax.parallel.sharding import host_array
from rlver_jax.rl.update import Updater
from rlver_jax.train import loop as train
from rlver_jax.spec import RunSpec

CAP = 1.1  # low enough that on this rollout every kind of correction has something to do
MISMATCH_KEYS = ("mismatch/kl", "mismatch/kl_k1", "mismatch/log_ratio_abs_max",
                 "mismatch/log_ratio_abs_mean", "mismatch/seq_log_ratio_abs_max",
                 "mismatch/token_mask_drop_frac", "mismatch/seq_mask_drop_frac",
                 "mismatch/geo_mask_drop_frac")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


@pytest.fixture(scope="module")
def rollout(world, tmp_path_factory):
  """A trainer and one step's batch, sampled at T=0.7 so the sampler's log-probs are not the
  trainer's (a correction is then required; token_tis here, each test picks its own)."""
  config = tiny_world.training_config(world, "grpo", total_steps=1, **{
      "policy.temperature": 0.7, "rl.is_correction": "token_tis", "rl.is_cap": CAP})
  trainer = tiny_world.trainer(config, str(tmp_path_factory.mktemp("run")))
  with jax.set_mesh(trainer.mesh):
    dialogues, _ = trainer.rollout(jax.random.key(0))
    batch, extra = trainer.make_batch(dialogues)
  assert batch.mini_batches == 1
  yield trainer, batch, extra
  trainer.checkpointer.close()


def _update(trainer, batch, optimizer, **rl):
  """One update of a copy of the rollout's policy, with the loss config of config.rl + `rl`."""
  spec = dataclasses.replace(trainer.spec, rl=dataclasses.replace(trainer.spec.rl, **rl))
  up = Updater(trainer.policy, optimizer, "policy", spec.loss_config())
  params = jax.tree.map(jnp.copy, trainer.state.policy)
  with jax.set_mesh(trainer.mesh):
    new, _, metrics = up.step(params, up.init(params), batch)
  return new, {k: float(v) for k, v in metrics.items()}


def _numpy_weights(batch, kind: str) -> np.ndarray:
  """Each policy token's correction weight, recomputed in float64 from the batch's log-probs."""
  T = batch.tokens.shape[-1]
  flat = lambda x: np.asarray(host_array(x), np.float64).reshape(-1, T)
  mask = flat(batch.loss_mask) > 0
  delta = np.where(mask, flat(batch.old_logp) - flat(batch.rollout_logp), 0.0)
  seq = delta.sum(-1, keepdims=True) + 0 * delta
  geo = seq / np.maximum(mask.sum(-1, keepdims=True), 1)
  inside = lambda x: (np.abs(x) <= np.log(CAP)).astype(np.float64)
  w = {"token_tis": np.minimum(np.exp(delta), CAP), "seq_tis": np.minimum(np.exp(seq), CAP),
       "token_mask": inside(delta), "seq_mask": inside(seq), "geo_mask": inside(geo)}[kind]
  return w[mask]


@pytest.mark.parametrize("kind", ["token_tis", "seq_tis", "token_mask", "seq_mask", "geo_mask"])
def test_each_correction_weighs_the_update_by_the_batchs_ratios(rollout, kind):
  trainer, batch, _ = rollout
  new, m = _update(trainer, batch, optax.adam(1e-3), is_correction=kind, is_cap=CAP)
  expected = _numpy_weights(batch, kind)
  np.testing.assert_allclose(m["is_weight_mean"], expected.mean(), rtol=1e-4)
  if kind != "geo_mask":  # the geometric means all stay inside [1/1.1, 1.1] on this rollout
    assert expected.min() < 0.95, expected.min()
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new))


def test_loss_variants_take_ppos_first_update(rollout):
  # The first update is on-policy (ratio 1): ppo, gspo and cispo all have gradient -w A grad logp.
  # SGD moves the params by the gradient itself, so equal params mean equal gradients.
  trainer, batch, _ = rollout
  params = {k: _update(trainer, batch, optax.sgd(1.0), policy_loss=k)[0]
            for k in ("ppo", "gspo", "cispo")}
  moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
              for a, b in zip(jax.tree.leaves(params["ppo"]), jax.tree.leaves(trainer.state.policy)))
  assert moved > 1e-4
  for kind in ("gspo", "cispo"):
    for a, b in zip(jax.tree.leaves(params["ppo"]), jax.tree.leaves(params[kind])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, err_msg=kind)


def test_make_batch_measures_the_mismatch(rollout):
  trainer, batch, extra = rollout
  T = batch.tokens.shape[-1]
  flat = lambda x: np.asarray(host_array(x), np.float64).reshape(-1, T)
  mask = flat(batch.loss_mask) > 0
  delta = (flat(batch.old_logp) - flat(batch.rollout_logp))[mask]
  assert extra["mismatch/kl"] == pytest.approx(np.mean(np.exp(delta) - 1 - delta), rel=1e-6)
  assert extra["mismatch/log_ratio_abs_max"] == pytest.approx(np.abs(delta).max(), rel=1e-6)
  token_drop = 1 - _numpy_weights(batch, "token_mask").mean()
  assert extra["mismatch/token_mask_drop_frac"] == pytest.approx(token_drop) and token_drop > 0


def _rows(workdir):
  return [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra", [
    {},
    {"policy.temperature": 0.7, "rl.policy_loss": "gspo", "rl.loss_agg": "seq-mean-token-mean",
     "rl.is_correction": "geo_mask", "rl.is_cap": 1.5},
    {"policy.temperature": 0.7, "rl.policy_loss": "cispo", "rl.is_correction": "token_tis",
     "rl.is_cap": 2.0}])
def test_every_run_logs_the_mismatch(world, tmp_path, extra):
  config = tiny_world.training_config(world, "grpo", total_steps=2, **extra)
  train.run(RunSpec.from_config(config), str(tmp_path))
  rows = _rows(tmp_path)
  assert len(rows) == 2
  events = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  for key in MISMATCH_KEYS:
    assert all(np.isfinite(r[key]) for r in rows), key
    assert key.encode() in events, key  # every scalar goes to TensorBoard under its own tag
  if not extra:  # T=1: sampler and trainer agree up to fp32 rounding of two forward paths
    assert "is_weight_mean" not in rows[0]
    assert max(r["mismatch/log_ratio_abs_max"] for r in rows) < 1e-4
  else:
    assert all(r["mismatch/kl"] > 1e-4 for r in rows)
    assert 0 < rows[0]["is_weight_mean"] <= 2.0 and np.isfinite(rows[-1]["loss"])
