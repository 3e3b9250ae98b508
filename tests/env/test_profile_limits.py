"""Profiles refused early with their file and line: a line too long to be a profile (before it is
decoded), and, for the scripted simulator, a hidden intention or personality its rules do not know.
Where a profile was read is not part of its contents."""
import json

import pytest

from rlver_jax.env import profiles as P
from rlver_jax.run.provenance import profiles_sha256


def _row(i: int = 0, **overrides) -> str:
  row = {"id": f"p{i}", "player": "persona", "scene": "story", "main_cha": "passive",
         "cha_group": ["a"], "task": P.HIDDEN_INTENTIONS_EN[0], **overrides}
  return json.dumps(row, ensure_ascii=False)


def test_a_line_over_the_size_limit_is_refused_naming_it(tmp_path):
  path = tmp_path / "p.jsonl"
  huge = _row(1, player="x" * (P.MAX_LINE_BYTES + 1))
  path.write_text(_row(0) + "\n" + huge + "\n")
  with pytest.raises(P.ProfileError) as e:
    P.load_profiles(path)
  assert str(e.value) == (f"{path}:2: {len(huge.encode()):,} bytes, over the limit of "
                          f"{P.MAX_LINE_BYTES:,} for one profile (a persona this long fits no "
                          "simulator's context)")


def test_the_scripted_simulator_refuses_an_unknown_intention_naming_file_and_line(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text("\n".join([_row(0), _row(1, task="You want a pony.")]) + "\n")
  profiles = P.load_profiles(path)  # any text is a task for a model simulator
  with pytest.raises(P.ProfileError) as e:
    P.check_scripted_labels(profiles)
  assert str(e.value) == (f"{path}:2: unknown hidden intention: 'You want a pony.' (the scripted "
                          "simulator knows only RLVER's 8 hidden intentions and 3 personality types, "
                          "word for word as in its data)")
  P.check_scripted_labels(profiles[:1])


def test_where_a_profile_was_read_is_not_part_of_its_contents(tmp_path):
  (tmp_path / "a.jsonl").write_text(_row(0) + "\n")
  (tmp_path / "b.jsonl").write_text("\n" + _row(0) + "\n")
  a, b = P.load_profiles(tmp_path / "a.jsonl"), P.load_profiles(tmp_path / "b.jsonl")
  assert a[0].source != b[0].source and a == b
  assert profiles_sha256(a) == profiles_sha256(b)
