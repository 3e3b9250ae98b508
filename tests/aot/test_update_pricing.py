"""The step-time model prices the update on the rows the trainer makes: packed (rl.pack_update),
several samples a row, against a hand count."""
import pathlib
import runpy

from rlver_jax.aot import step_calls
from rlver_jax.aot import target as aot_target

_REPO = pathlib.Path(__file__).resolve().parents[2]


def _spec(pack: bool):
  config = runpy.run_path(str(_REPO / "configs" / "grpo_think.py"))["get_config"]("runlocal")
  for key, value in dict(pack_update=pack, profiles_per_step=2, group_size=2, micro_batch_size=1,
                         mini_batch_rows=0).items():
    setattr(config.rl, key, value)
  return aot_target.from_config(config)


def test_packed_update_rows_by_hand():
  """Thoughts dropped, 6 turns: a dialogue's samples are 40 + 21 (j - 1) + 16 tokens, 56..161, in
  rows of 192 (the longest, bucketed). One a row: 4 dialogues x 6 = 24 rows. Packed, each with its
  slot past the end (57, 78, 99, 120, 141, 162): 162 and 141 fit no partner, 120 + 57 and 99 + 78
  share a row: 4 x 4 = 16 rows, as many micro-batches of one row."""
  lengths = step_calls.StatedLengths(turns=6, policy_tokens=16, reply_tokens=10, user_tokens=10,
                                     simulator_tokens=40, policy_prompt=40, simulator_prompt=120,
                                     instruction_tokens=30)
  update = lambda calls: {k: v for k, v in calls.items() if k.startswith(("update/", "forward/"))}
  one = update(step_calls.stated_calls(_spec(False), lengths))
  packed = update(step_calls.stated_calls(_spec(True), lengths))
  assert one == {"update/micro_batches": 24, "update/rows": 1, "update/length": 192,
                 "forward/micro_batches": 24}
  assert packed == {"update/micro_batches": 16, "update/rows": 1, "update/length": 192,
                    "forward/micro_batches": 16}
