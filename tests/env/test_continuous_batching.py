"""Continuous batching (rollout.rows): fewer cache rows than dialogues, an ended dialogue's row lent
to the next waiting group. The dialogues (tokens, masks, user lines, rewards, endings) equal those of
the run with a row for every dialogue; with greedy sampling they equal today's lockstep rollout too.
Here the scripted simulator and the scheduler's parts; the co-located model: test_continuous_model."""
import jax
import numpy as np
import pytest
from flax import nnx

from continuous_world import GROUPS, Spy, make_sampler, same_dialogues
from rlver_jax.env.backends import ScriptedBackend
from rlver_jax.env.rollout import RolloutConfig, RolloutStats, run_dialogues
from rlver_jax.env.scheduler import AdmissionQueue, RowSlots, dialogue_keys
from rlver_jax.env.simulator import SimulatedUsers


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  from continuous_world import load_world
  return load_world(tmp_path_factory.mktemp("world"))


def _scripted_run(world, rows, temperature=1.0, seed=0):
  model, chat, profiles = world
  sampler = make_sampler(world, 256)
  spy = Spy(sampler)
  # Start 12, end below 10: a missed reply (-2) leaves 10, a second ends the dialogue; a rewarded
  # word ("try", "step", "plan": +4) buys turns; so dialogues end at different turns.
  users = SimulatedUsers(profiles, ScriptedBackend(), start_emotion=12, end_below=10, max_turns=5,
                         groups=GROUPS)
  stats = RolloutStats()
  cfg = RolloutConfig(think=False, max_new_tokens=10, temperature=temperature, rows=rows)
  dialogues = run_dialogues(profiles, GROUPS, users, sampler=sampler, params=nnx.state(model),
                            chat=chat, cfg=cfg, rng=jax.random.key(seed), stats=stats)
  return dialogues, spy, stats


def test_row_slots_lend_the_lowest_free_row():
  slots = RowSlots(3)
  assert [slots.take(d) for d in (7, 8, 9)] == [0, 1, 2]
  with pytest.raises(RuntimeError, match="no free cache row for dialogue 4"):
    slots.take(4)
  assert slots.release(8) == 1 and slots.take(4) == 1
  assert slots.holders(4) == [7, 4, 9, None]
  with pytest.raises(ValueError, match="already holds row"):
    slots.take(7)


def test_admission_starts_whole_groups_in_order():
  queue = AdmissionQueue([0, 0, 1, 1, 1, 2], rows=4)
  assert queue.next_dialogues(4) == [0, 1]      # group 1 (3 rows) does not fit behind group 0
  assert queue.next_dialogues(2) == []          # nor in 2 rows; group 2 does not overtake it
  assert queue.next_dialogues(4) == [2, 3, 4, 5] and not queue.waiting
  with pytest.raises(ValueError, match=r"rollout.rows=2: a group of 3 dialogues"):
    AdmissionQueue([0, 0, 0], rows=2)
  assert AdmissionQueue([0, 0, 0], rows=2, together=False).next_dialogues(2) == [0, 1]


def test_dialogue_keys_follow_the_dialogue_not_the_row():
  base = jax.random.key(0)
  a = dialogue_keys(base, [3, None, 5], [1, 0, 2])
  b = dialogue_keys(base, [5, 3], [2, 1])
  data = lambda k: np.asarray(jax.random.key_data(k))
  np.testing.assert_array_equal(data(a)[0], data(b)[1])
  np.testing.assert_array_equal(data(a)[2], data(b)[0])
  assert not np.array_equal(data(a)[0], data(a)[2])


@pytest.mark.parametrize("rows", [2, 4])
def test_fewer_rows_give_the_same_dialogues_scripted(world, rows):
  full, full_spy, full_stats = _scripted_run(world, rows=len(GROUPS))
  part, spy, stats = _scripted_run(world, rows=rows)
  same_dialogues(full, part)
  # The dialogues end at different turns, so rows were lent again while others went on.
  turns = [len(d.policy_replies) for d in full]
  assert len(set(turns)) > 1
  assert set(spy.batches) == {rows} and max(spy.active) == rows
  assert len(spy.active) > len(full_spy.active)  # more decode calls, each on fewer rows
  assert sum(spy.active) == sum(full_spy.active) == sum(turns)
  # Each group's shared prompt is prefilled once either way.
  assert stats.policy_prefill_tokens == full_stats.policy_prefill_tokens
  assert stats.policy_tokens == full_stats.policy_tokens


def test_greedy_continuous_equals_todays_lockstep(world):
  # rows=0 is the lockstep rollout with one key per turn; greedy draws no key, so continuous
  # batching on 2 rows must reproduce it token for token.
  lockstep, _, _ = _scripted_run(world, rows=0, temperature=0.0)
  continuous, _, _ = _scripted_run(world, rows=2, temperature=0.0)
  same_dialogues(lockstep, continuous)


def test_opening_a_member_without_its_leader_is_refused(world):
  _, _, profiles = world
  users = SimulatedUsers(profiles[:4], ScriptedBackend(), groups=GROUPS[:4])
  with pytest.raises(ValueError, match="dialogue 1 starts without its group's first dialogue 0"):
    users.opening([1])
  users.opening([0, 1])
  with pytest.raises(RuntimeError, match="dialogue 2 has not started"):
    users.step([2], ["hello"])
  with pytest.raises(RuntimeError, match="already called for dialogue 0"):
    users.opening([0, 1])
  with pytest.raises(ValueError, match="dialogue 0 is still running"):
    users.release(0)


def test_rollout_rows_config_is_checked():
  from rlver_jax.spec import ConfigError, RolloutSpec, RunSpec, RLSpec
  with pytest.raises(ConfigError, match=r"config.rollout.rows=-1: must be an integer >= 0"):
    RolloutSpec(rows=-1)
  rl = RLSpec(group_size=4, profiles_per_step=3)  # 12 dialogues a step
  for bad in (3, 13):
    with pytest.raises(ConfigError, match=rf"^config.rollout.rows={bad}: must be 0 \(lockstep\) or in "
                       r"\[rl.group_size=4, the step's 12 dialogues"):
      RunSpec(rl=rl, rollout=RolloutSpec(rows=bad))
  assert RunSpec(rl=rl, rollout=RolloutSpec(rows=12)).rollout_config().rows == 12
  spec = RunSpec(rl=rl, rollout=RolloutSpec(rows=6))  # not a multiple of the group: allowed
  assert spec.rollout_config().rows == 6 and spec.holdout_rollout_config().rows == 6
  assert RunSpec().rollout_config().rows == 0
