"""A step that teaches nothing is named: an unreadable simulator (its share and likely causes) and
groups whose rewards are all equal."""
from rlver_jax.train.step_warnings import step_warnings


def _warn(**kw):
  args = dict(rewards=[0.3, 0.4, 0.3, 0.3], groups=[0, 0, 1, 1], parsed=[[True, True]] * 4,
              user_lines=12, silent_replies=0, backend="model", max_new_tokens=40)
  return step_warnings(7, **{**args, **kw})


def test_a_step_with_signal_and_readable_answers_is_quiet():
  assert _warn() == []
  # Exactly half unreadable is not above the threshold.
  assert _warn(parsed=[[True, False]] * 4, silent_replies=6) == []


def test_mostly_unreadable_change_lines_name_the_rate_and_causes():
  lines = _warn(parsed=[[False, False], [False, True], [True, False], [False, False]])
  assert len(lines) == 1
  line = lines[0]
  assert line.startswith("step 7:") and "6 of 8 emotion steps (75%)" in line
  assert "simulator.checkpoint" in line and "simulator.max_new_tokens=40" in line
  http = _warn(parsed=[[False]] * 4, backend="http", max_new_tokens=64)[0]
  assert "simulator.http_model" in http and "simulator.max_new_tokens=64" in http


def test_mostly_silent_user_lines_are_named():
  lines = _warn(silent_replies=7)
  assert len(lines) == 1 and "7 of 12 user lines (58%)" in lines[0]


def test_equal_rewards_in_every_group_mean_no_signal():
  lines = _warn(rewards=[0.3, 0.3, 0.28, 0.28])
  assert len(lines) == 1 and "every group" in lines[0] and "[0.28, 0.3]" in lines[0]
  # One group with a spread is enough to learn from.
  assert _warn(rewards=[0.3, 0.3, 0.28, 0.26]) == []
  # PPO passes one group for the whole batch.
  assert "the whole batch" in _warn(rewards=[0.3] * 4, groups=[0] * 4)[0]
  assert _warn(rewards=[0.3, 0.3, 0.3, 0.31], groups=[0] * 4) == []


def test_both_problems_give_both_warnings():
  lines = _warn(rewards=[0.3] * 4, parsed=[[False]] * 4)
  assert len(lines) == 2 and "change line" in lines[0] and "same within" in lines[1]


def test_an_advantage_judge_overrides_the_reward_spread():
  # GRPO with turn credit: tied final rewards along different emotion paths still teach.
  assert _warn(rewards=[0.3] * 4, has_signal=True) == []
  assert "same within" in _warn(rewards=[0.3, 0.4, 0.3, 0.3], has_signal=False)[0]


def test_the_loop_asks_turn_credit_for_the_signal():
  import types
  from rlver_jax.rl.algorithms import GRPO
  from rlver_jax.train.loop import warn_about_step

  def dialogue(emotions):
    return types.SimpleNamespace(termination="max_turns", reward=emotions[-1] / 100, group_id=0,
                                 emotions=emotions, parsed=[True] * (len(emotions) - 1),
                                 user_lines=["a"] * len(emotions), silent_replies=0)

  def warnings(credit):
    spec = types.SimpleNamespace(
        simulator=types.SimpleNamespace(backend="model", max_new_tokens=40),
        algorithm=GRPO(turn_credit=credit))
    return warn_about_step(spec, 3, [dialogue([30, 40, 35]), dialogue([30, 25, 35])])

  assert warnings("turn_index") == []  # the same final 35, reached two ways
  assert "same within" in warnings("none")[0]
