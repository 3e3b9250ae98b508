"""Turn-level credit against hand-computed dialogues: turn rewards, returns-to-go, both
normalisations, the tokens each turn's advantage lands on, and which groups carry a signal."""
import dataclasses

import numpy as np
import pytest

from rlver_jax.rl.algorithms import GRPO
from rlver_jax.rl.pack import pack
from rlver_jax.rl.turn_credit import (dialogue_turn_advantages, returns_to_go, turn_rewards,
                                      turn_row_advantages)


@dataclasses.dataclass
class _Sample:
  tokens: list
  loss_mask: list
  turn_ends: list
  sampler_logp: list = None
  token_rewards: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    self.sampler_logp = [0.0] * len(self.tokens)


@dataclasses.dataclass
class _Dialogue:
  reward: float
  group_id: int
  emotions: list
  samples: list = dataclasses.field(default_factory=list)


# Group 0: A climbs twice, B drops and ends after one turn, C waits then climbs.
# Group 1: D is format-penalised (reward 0 though its emotion ends at 35), E climbs.
A = _Dialogue(0.38, 0, [30, 34, 38])   # turn rewards .04 .04        -> returns .08 .04
B = _Dialogue(0.28, 0, [30, 28])       # -.02                        -> -.02
C = _Dialogue(0.40, 0, [30, 30, 40])   # 0 .10                       -> .10 .10
D = _Dialogue(0.00, 1, [30, 35, 35])   # .05, 0 + (0 - .35) = -.35   -> -.30 -.35
E = _Dialogue(0.36, 1, [30, 32, 36])   # .02 .04                     -> .06 .04
DIALOGUES = [A, B, C, D, E]
S = 0.7071068  # a pair of different values: +-(d / 2) / (d / sqrt(2)) = +-1 / sqrt(2)


def test_turn_rewards_sum_to_the_reward_minus_the_start_and_carry_a_penalty_on_the_last_turn():
  np.testing.assert_allclose(turn_rewards(A.emotions, A.reward), [0.04, 0.04], atol=1e-12)
  np.testing.assert_allclose(turn_rewards(D.emotions, D.reward), [0.05, -0.35], atol=1e-12)
  np.testing.assert_allclose(returns_to_go(np.array([0.05, -0.35])), [-0.30, -0.35], atol=1e-12)
  for d in DIALOGUES:
    assert turn_rewards(d.emotions, d.reward).sum() == pytest.approx(d.reward - 0.30, abs=1e-12)


def test_turn_index_normalises_over_the_dialogues_that_reached_each_turn():
  adv = dialogue_turn_advantages(DIALOGUES, mode="turn_index")
  # Group 0, turn 0: returns .08 -.02 .10, mean .053333, std (ddof 1) sqrt(.0082667 / 2) = .0642910.
  # Turn 1: only A (.04) and C (.10) reached it. Group 1 has two members per turn.
  np.testing.assert_allclose(adv[0], [0.0266667 / 0.0642910, -S], rtol=2e-4)
  np.testing.assert_allclose(adv[1], [-0.0733333 / 0.0642910], rtol=2e-4)
  np.testing.assert_allclose(adv[2], [0.0466667 / 0.0642910, S], rtol=2e-4)
  np.testing.assert_allclose(adv[3], [-S, -S], rtol=2e-4)
  np.testing.assert_allclose(adv[4], [S, S], rtol=2e-4)


def test_all_turns_normalises_over_every_turn_of_the_group():
  adv = dialogue_turn_advantages(DIALOGUES, mode="all_turns")
  # Group 0: .08 .04 -.02 .10 .10, mean .06, std sqrt(.0104 / 4) = .0509902.
  g0 = np.array([0.02, -0.02, -0.08, 0.04, 0.04]) / 0.0509902
  # Group 1: -.30 -.35 .06 .04, mean -.1375, std sqrt(.142075 / 3) = .2176197.
  g1 = np.array([-0.1625, -0.2125, 0.1975, 0.1775]) / 0.2176197
  np.testing.assert_allclose(np.concatenate(adv[:3]), g0, rtol=2e-4)
  np.testing.assert_allclose(np.concatenate(adv[3:]), g1, rtol=2e-4)
  # Dr.GRPO: centred only.
  adv = dialogue_turn_advantages(DIALOGUES, mode="all_turns", mean_only=True)
  np.testing.assert_allclose(np.concatenate(adv[3:]), [-0.1625, -0.2125, 0.1975, 0.1775], atol=1e-6)


def test_each_turns_tokens_get_its_advantage_in_one_sequence_and_in_per_turn_samples():
  # One sequence: turn 0's sampled tokens are 2-3 (ends at 3), turn 1's 6-8 (ends at 8).
  seq = _Sample(list(range(10)), [0, 0, 1, 1, 0, 0, 1, 1, 1, 0], [3, 8])
  # Think mode: the same dialogue as two samples, one per turn.
  t0 = _Sample([5, 6, 7, 8], [0, 0, 1, 1], [3])
  t1 = _Sample([5, 6, 9, 9, 7, 8, 4], [0, 0, 0, 0, 0, 1, 1], [6])
  dialogues = [_Dialogue(0.3, 0, [30, 30, 30], [seq]), _Dialogue(0.3, 0, [30, 30, 30], [t0, t1])]
  per_turn = [np.array([0.5, -2.0], np.float32), np.array([1.5, 3.0], np.float32)]
  p = pack(dialogues, 1, 0)
  out = turn_row_advantages(dialogues, p, per_turn)
  np.testing.assert_array_equal(out[0, :10], [0, 0, 0.5, 0.5, 0, 0, -2, -2, -2, 0])
  np.testing.assert_array_equal(out[1, :4], [0, 0, 1.5, 1.5])
  np.testing.assert_array_equal(out[2, :7], [0, 0, 0, 0, 0, 3.0, 3.0])
  assert not out[:, 10:].any() and not out[1, 4:].any() and not out[3:].any()


def test_a_dialogue_with_more_turns_than_emotion_changes_is_refused():
  d = _Dialogue(0.3, 0, [30, 30], [_Sample([1, 2, 3, 4], [0, 1, 0, 1], [1, 3])])
  with pytest.raises(ValueError, match="2 policy turns in its samples but 1 emotion changes"):
    turn_row_advantages([d], pack([d], 1, 0), [np.zeros(1, np.float32)])


def test_grpo_with_turn_credit_finds_signal_where_final_rewards_tie():
  # Both end at 30 (terminal advantages 0), but one went up first and the other down.
  up, down = _Dialogue(0.30, 0, [30, 34, 30]), _Dialogue(0.30, 0, [30, 26, 30])
  other = [_Dialogue(0.35, 1, [30, 35]), _Dialogue(0.30, 1, [30, 30])]
  assert GRPO().informative_groups([up, down, *other]) == {1}
  assert GRPO(turn_credit="turn_index").informative_groups([up, down, *other]) == {0, 1}
  # Turn 0's returns are 0 and 0 (a tie), turn 1's -.04 and +.04.
  adv = dialogue_turn_advantages([up, down], mode="turn_index")
  np.testing.assert_allclose(np.concatenate(adv), [0, -S, 0, S], rtol=2e-4, atol=1e-7)
  assert GRPO().informative_groups([]) == set()
