"""The trainer's update loop never waits for the device: every optimizer update of a step (policy and
critic, every mini-batch and epoch) is dispatched before any value comes back to the host, and the
metrics come back in one fetch after the last. Equal update configs share one compiled program."""
import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax._src import array as jax_array

from rlver_jax.models.factory import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.rl.algorithms import PPO
from rlver_jax.rl.batch import UpdateBatch
from rlver_jax.rl.update import LossConfig, OptimConfig, Updater, make_optimizer, update_program
from rlver_jax.spec import RunSpec
from rlver_jax.train.state import TrainState
from rlver_jax.train.trainer import Trainer

CFG = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def _batch(rng, micro=4, rows=2, T=10):
  shape = (micro, rows, T)
  mask = np.zeros(shape, np.float32)
  mask[..., 3:] = 1.0
  mask[-1] = 0.0  # the last micro-batch is padding: mini-batch 1 then has half the tokens
  f = lambda: jnp.asarray(rng.randn(*shape).astype(np.float32) * 0.1)
  return UpdateBatch(tokens=jnp.asarray(rng.randint(1, 50, size=shape)),
                     segment_ids=jnp.ones(shape, jnp.int32), loss_mask=jnp.asarray(mask),
                     old_logp=f() - 3.0, advantages=f(), old_values=f(), returns=f(),
                     mini_batches=2)


def _trainer(epochs=2):
  spec = RunSpec.from_config({"algo": "ppo", "rl": {"epochs": epochs, "group_size": 1},
                              "optim": {"warmup_unit": "steps"}})
  policy = create_model(CFG, dtype=jnp.float32, seed=1)
  critic = create_model(CFG, head="value", dtype=jnp.float32, seed=2)
  opt = make_optimizer(OptimConfig(learning_rate=1e-3))
  t = SimpleNamespace(spec=spec, step=3, algorithm=PPO(),
                      policy_up=Updater(policy, opt, "policy", LossConfig()),
                      critic_up=Updater(critic, opt, "value", LossConfig()))
  p, c = nnx.state(policy, nnx.Param), nnx.state(critic, nnx.Param)
  t.state = TrainState(policy=p, policy_opt=t.policy_up.init(p), rng=jnp.zeros(2, jnp.uint32),
                       critic=c, critic_opt=t.critic_up.init(c))
  for name in ("_step_warmup", "dispatch_updates", "update"):
    setattr(t, name, functools.partial(getattr(Trainer, name), t))
  return t


def test_no_host_fetch_between_the_first_and_the_last_update(monkeypatch):
  trainer = _trainer()
  events = []
  value = jax_array.ArrayImpl._value

  def fetched(self):
    events.append("fetch")
    return value.fget(self)

  for up in (trainer.policy_up, trainer.critic_up):
    step = up.step

    def logged(*args, _step=step, **kwargs):
      events.append("update")
      return _step(*args, **kwargs)

    monkeypatch.setattr(up, "step", logged)
  monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(fetched))
  metrics = trainer.update(_batch(np.random.RandomState(0)))
  monkeypatch.undo()
  updates = [i for i, e in enumerate(events) if e == "update"]
  assert len(updates) == 2 * 2 * 2  # policy + critic, 2 mini-batches, 2 epochs
  assert "fetch" not in events[updates[0]:updates[-1]]
  assert "fetch" in events[updates[-1]:]  # the metrics, once the last update is on its way
  assert metrics["optimizer_updates"] == 4
  assert np.isfinite(metrics["pg_loss"]) and np.isfinite(metrics["critic/vf_loss"])


def test_the_fetched_metrics_match_each_update():
  # The same updates run one at a time (their metrics fetched after each) give the same numbers.
  batch = _batch(np.random.RandomState(1))
  fast = _trainer(epochs=1).update(batch)
  slow = _trainer(epochs=1)
  seen = []
  for part in range(2):
    policy, policy_opt, m = slow.policy_up.step(  # lr_scale: step 3 of a 10-step warm-up
        slow.state.policy, slow.state.policy_opt, batch.mini_batch(part), lr_scale=0.3)
    slow.state = dataclasses.replace(slow.state, policy=policy, policy_opt=policy_opt)
    seen.append(float(m["pg_loss"]))
  # Mini-batch 0 holds 2 micro-batches of tokens, mini-batch 1 one: weights 2 : 1.
  np.testing.assert_allclose(fast["pg_loss"], (2 * seen[0] + seen[1]) / 3, rtol=1e-6)


def test_equal_configs_share_one_program():
  a = create_model(CFG, dtype=jnp.float32, seed=1)
  b = create_model(CFG, dtype=jnp.float32, seed=5)
  cfg = LossConfig()
  opt = make_optimizer(OptimConfig(learning_rate=1e-3))
  assert opt is make_optimizer(OptimConfig(learning_rate=1e-3))
  ua, ub = Updater(a, opt, "policy", cfg), Updater(b, opt, "policy", cfg)
  assert ua._step.program is ub._step.program
  assert Updater(a, opt, "value", cfg)._step.program is not ua._step.program
  assert update_program(ua.graphdef, optax.sgd(1.0), "policy", cfg) is not ua._step.program
