"""rl.turn_credit through one real training step on the tiny world: every policy token's advantage
is its turn's normalised return-to-go of emotion changes, recomputed here with numpy from the
rollout's own emotions (think mode: one sample per turn; no think: turns inside one sequence)."""
import jax
import numpy as np
import pytest

import tiny_world
from rlver_jax.parallel.sharding import host_array


def _reference(dialogues, mode):
  """Per dialogue, per turn: (G - mean) / (std + 1e-6) over the group's returns at that turn index
  ("turn_index") or over all of its turns ("all_turns"); 0 for one member or equal values."""
  returns = []
  for d in dialogues:
    r = np.diff(np.asarray(d.emotions, float)) / 100
    r[-1] += d.reward - d.emotions[-1] / 100
    returns.append(np.cumsum(r[::-1])[::-1])
  pools = {}
  for d, g in zip(dialogues, returns):
    for k, v in enumerate(g):
      pools.setdefault((d.group_id, k if mode == "turn_index" else 0), []).append(v)
  out = []
  for d, g in zip(dialogues, returns):
    adv = []
    for k, v in enumerate(g):
      pool = np.array(pools[d.group_id, k if mode == "turn_index" else 0])
      ok = pool.size > 1 and np.ptp(pool) > 0
      adv.append((v - pool.mean()) / (pool.std(ddof=1) + 1e-6) if ok else 0.0)
    out.append(adv)
  return out


@pytest.mark.parametrize("think,mode", [(True, "turn_index"), (False, "all_turns")])
def test_turn_credit_advantages_in_a_real_step(tmp_path, think, mode):
  world = tiny_world.make_world(tmp_path / "world")
  config = tiny_world.training_config(world, "grpo", total_steps=1, **{
      "policy.think": think, "simulator.max_turns": 3, "rl.mini_batch_rows": 0,
      "rl.turn_credit": mode})
  trainer = tiny_world.trainer(config, str(tmp_path / "run"))
  with jax.set_mesh(trainer.mesh):
    dialogues, _ = trainer.rollout(jax.random.key(5))
    batch, _ = trainer.make_batch(dialogues)
    metrics = trainer.update(batch)
  trainer.checkpointer.close()
  flat = lambda k: np.asarray(host_array(getattr(batch, k))).reshape(-1, batch.tokens.shape[-1])
  mask, adv, seg = flat("loss_mask"), flat("advantages"), flat("segment_ids")
  expected = _reference(dialogues, mode)
  assert any(len(set(np.round(a, 6))) > 1 for a in expected)  # turns of a dialogue differ
  k = 0  # sample k has segment id k + 1, packed or one a row
  for d, per_turn in zip(dialogues, expected):
    first = 0
    for s in d.samples:
      n = len(s.tokens)
      (row, t), = np.argwhere(np.diff(np.pad(seg == k + 1, ((0, 0), (1, 0))).astype(int)) == 1)
      turn_of = first + np.searchsorted(s.turn_ends, np.arange(n))
      want = np.where(np.asarray(s.loss_mask) > 0, np.asarray(per_turn + [0.0])[
          np.minimum(turn_of, len(per_turn))], 0.0)
      np.testing.assert_allclose(adv[row, t:t + n], want, rtol=1e-4, atol=1e-5)
      assert (seg[row, t:t + n] == k + 1).all() and (seg == k + 1).sum() == n
      first += len(s.turn_ends)
      k += 1
  assert k == sum(len(d.samples) for d in dialogues) and seg.max() == k
  assert not adv[seg == 0].any() and not mask[seg == 0].any()
  assert (k > len(dialogues)) == think  # think: one sample per turn
  assert np.isfinite(metrics["loss"]) and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
