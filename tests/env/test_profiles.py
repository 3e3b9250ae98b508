"""Tests for profile loading, validation, labels, sampling and splitting."""
from __future__ import annotations

import collections
import json
import pathlib

import numpy as np
import pytest

from rlver_jax.env import profiles as P

TRAIN_PATH = (pathlib.Path(__file__).resolve().parents[3]
              / "shared/data/rlver_profiles/train_profile.jsonl")


def _row(i: int = 0, **overrides) -> dict:
  row = {"id": f"p{i}", "player": "persona", "scene": "story", "main_cha": "passive",
         "cha_group": ["a", "b", "c"], "task": P.HIDDEN_INTENTIONS_EN[0]}
  row.update(overrides)
  return row


def _write(tmp_path, lines: list[str], name: str = "p.jsonl") -> str:
  path = tmp_path / name
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return str(path)


def _make(n: int) -> list[P.Profile]:
  return [P.Profile(id=f"p{i}", player="x", scene="y", main_cha="passive", cha_group=(),
                    task=P.HIDDEN_INTENTIONS_EN[i % 8]) for i in range(n)]


# --- Loading and validation ---------------------------------------------------------------------

def test_load_valid_file_skips_blank_lines_and_ignores_extra_keys(tmp_path):
  path = _write(tmp_path, [json.dumps(_row(0)), "", "   ",
                           json.dumps(_row(1, extra=[1, 2], first_talk="hi"))])
  got = P.load_profiles(path)
  assert [p.id for p in got] == ["p0", "p1"]
  assert got[0].first_talk is None and got[1].first_talk == "hi"
  assert got[0].cha_group == ("a", "b", "c")
  assert got[0].language == "en"


def test_load_accepts_null_first_talk_and_pathlike(tmp_path):
  path = _write(tmp_path, [json.dumps(_row(0, first_talk=None))])
  assert P.load_profiles(pathlib.Path(path))[0].first_talk is None


BAD_LINES = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('"text"', "expected a JSON object, got str"),
    (json.dumps({k: v for k, v in _row().items() if k != "scene"}),
     "missing required field(s): scene"),
    (json.dumps({k: v for k, v in _row().items() if k not in ("id", "task")}),
     "missing required field(s): id, task"),
    (json.dumps(_row(id=7)), "field 'id' must be a string, got int"),
    (json.dumps(_row(player=None)), "field 'player' must be a string, got NoneType"),
    (json.dumps(_row(task="  ")), "field 'task' is empty"),
    (json.dumps(_row(cha_group="a,b")), "field 'cha_group' must be a list of strings"),
    (json.dumps(_row(cha_group=["a", 3])), "field 'cha_group' must be a list of strings"),
    (json.dumps(_row(first_talk=5)), "field 'first_talk' must be a string, got int"),
    (json.dumps(_row(first_talk="")), "field 'first_talk' is empty"),
]


@pytest.mark.parametrize("bad,what", BAD_LINES)
def test_bad_line_names_file_and_line(tmp_path, bad, what):
  path = _write(tmp_path, [json.dumps(_row(0)), "", bad, json.dumps(_row(9))])
  with pytest.raises(P.ProfileError) as info:
    P.load_profiles(path)
  msg = str(info.value)
  assert msg.startswith(f"{path}:3: ")
  assert what in msg
  assert "\n" not in msg


@pytest.mark.parametrize("bad,what", [
    ('{"id": "p0", "player": "Sam', "invalid JSON (unterminated string starting at column 24)"),
    ('{"id": "p0" "player": 1}', "invalid JSON (expecting ',' delimiter at column 13)"),
    ('{"id": "p0"} x', "invalid JSON (extra data at column 14)"),
])
def test_invalid_json_reads_as_one_sentence(tmp_path, bad, what):
  # json's own messages are written to be followed by ": line L column C" ("... starting at").
  path = _write(tmp_path, [bad])
  with pytest.raises(P.ProfileError) as info:
    P.load_profiles(path)
  assert str(info.value) == f"{path}:1: {what}"


def test_duplicate_id_names_both_lines(tmp_path):
  path = _write(tmp_path, [json.dumps(_row(0)), json.dumps(_row(1)), json.dumps(_row(0))])
  with pytest.raises(P.ProfileError, match=r":3: duplicate id 'p0' \(first on line 1\)"):
    P.load_profiles(path)


def test_invalid_utf8_names_line(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_bytes(json.dumps(_row(0)).encode() + b"\n\xff\xfe\n")
  with pytest.raises(P.ProfileError, match=f"^{path}:2: not valid UTF-8$"):
    P.load_profiles(str(path))


def test_utf8_bom_is_accepted(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_row(0)).encode() + b"\n")
  assert len(P.load_profiles(str(path))) == 1


def test_missing_file(tmp_path):
  path = str(tmp_path / "nope.jsonl")
  with pytest.raises(FileNotFoundError) as info:
    P.load_profiles(path)
  assert isinstance(info.value, P.ProfileError)
  assert str(info.value) == f"{path}: profile file not found"


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
  path = tmp_path / "empty.jsonl"
  path.write_text(content)
  with pytest.raises(P.ProfileError, match="no profiles"):
    P.load_profiles(str(path))


def test_bad_gs_path():
  with pytest.raises(P.ProfileError, match="expected gs://bucket/object"):
    P.load_profiles("gs://only-bucket")


def test_profile_error_is_value_error():
  assert issubclass(P.ProfileError, ValueError)


# --- Real training data and demo profiles -------------------------------------------------------

def test_training_data_counts():
  if not TRAIN_PATH.exists():
    pytest.skip(f"../shared not present: {TRAIN_PATH}")
  profs = P.load_profiles(str(TRAIN_PATH))
  assert len(profs) == 500
  assert all(p.language == "zh" and p.first_talk is None for p in profs)
  tasks = collections.Counter(P.intention_key(p) for p in profs)
  assert tasks == {"no_fault": 66, "self_reflection": 66, "critical_analysis": 66,
                   "deep_empathy": 64, "listen_venting": 63, "others_motives": 60,
                   "actionable_advice": 58, "sincere_praise": 57}
  types = collections.Counter(P.personality_key(p) for p in profs)
  assert types == {"negative": 183, "passive": 174, "avoidant": 143}
  assert collections.Counter(p.main_cha for p in profs) == {"负面型": 183, "被动型": 174,
                                                            "回避型": 143}


def test_demo_profiles_cover_all_labels():
  profs = P.load_demo_profiles()
  assert len(profs) == 8
  assert pathlib.Path(P.DEMO_PROFILES).name == "demo_profiles.jsonl"
  assert sorted(p.task for p in profs) == sorted(P.HIDDEN_INTENTIONS_EN)
  assert sorted(P.intention_key(p) for p in profs) == sorted(P.INTENTION_KEYS)
  types = collections.Counter(p.main_cha for p in profs)
  assert set(types) == set(P.PERSONALITY_KEYS) and min(types.values()) >= 2
  assert sum(p.first_talk is not None for p in profs) == 2
  for p in profs:
    assert p.language == "en"
    assert len(p.cha_group) == 3
    assert 80 <= len(p.player.split()) <= 150, p.id
    assert 200 <= len(p.scene.split()) <= 300, p.id
    assert p.scene.rstrip().splitlines()[-1] == f"Hidden theme: {p.task}"


def test_label_tables():
  assert len(P.HIDDEN_INTENTIONS_EN) == len(P.HIDDEN_INTENTIONS_ZH) == len(P.INTENTION_KEYS) == 8
  assert len(P.TASK_TO_INTENTION) == 16
  for en, zh, key in zip(P.HIDDEN_INTENTIONS_EN, P.HIDDEN_INTENTIONS_ZH, P.INTENTION_KEYS):
    assert P.intention_key(en) == P.intention_key(zh) == key
  assert P.HIDDEN_INTENTIONS_EN[4] == (
      "You want the other person to listen attentively while you vent your emotions.")
  assert [P.personality_key(z) for z in ("负面型", "被动型", "回避型")] == list(P.PERSONALITY_KEYS)
  assert P.personality_key("avoidant") == "avoidant"
  with pytest.raises(ValueError):
    P.intention_key("something else")
  with pytest.raises(ValueError):
    P.personality_key("cheerful")


# --- Sampler ------------------------------------------------------------------------------------

def test_sampler_is_deterministic_and_covers_each_epoch():
  profs = _make(10)
  a = P.ProfileSampler(profs, seed=3)
  b = P.ProfileSampler(profs, seed=3)
  first = a.next_batch(10)
  assert [p.id for p in first] == [p.id for p in b.next_batch(10)]
  assert sorted(p.id for p in first) == sorted(p.id for p in profs)
  assert a.epoch == 1 and a.position == 0
  second = a.next_batch(10)
  assert sorted(p.id for p in second) == sorted(p.id for p in profs)
  assert [p.id for p in first] != [p.id for p in second]  # Reshuffled per epoch.
  other = P.ProfileSampler(profs, seed=4).next_batch(10)
  assert [p.id for p in other] != [p.id for p in first]


def test_sampler_batches_cross_epoch_boundaries():
  profs = _make(7)
  whole = P.ProfileSampler(profs, seed=1).next_batch(21)
  s = P.ProfileSampler(profs, seed=1)
  pieces = s.next_batch(5) + s.next_batch(5) + s.next_batch(0) + s.next_batch(11)
  assert [p.id for p in pieces] == [p.id for p in whole]
  assert s.state_dict() == {"seed": 1, "epoch": 3, "position": 0, "num_profiles": 7}
  for e in range(3):
    assert sorted(p.id for p in whole[7 * e:7 * e + 7]) == sorted(p.id for p in profs)


@pytest.mark.parametrize("consumed", [0, 3, 7, 10, 26])
def test_sampler_resume_matches_uninterrupted(consumed):
  profs = _make(8)
  ref = P.ProfileSampler(profs, seed=11)
  ref.next_batch(consumed)
  expected = [p.id for p in ref.next_batch(20)]

  s = P.ProfileSampler(profs, seed=11)
  s.next_batch(consumed)
  state = json.loads(json.dumps(s.state_dict()))  # Must survive a JSON round trip.
  assert all(type(v) is int for v in state.values())
  restored = P.ProfileSampler(profs, seed=0)  # The seed comes from the state.
  restored.load_state_dict(state)
  assert [p.id for p in restored.next_batch(20)] == expected


def test_sampler_state_validation():
  s = P.ProfileSampler(_make(4))
  with pytest.raises(ValueError, match="state is for 5 profiles"):
    s.load_state_dict({"seed": 0, "epoch": 0, "position": 0, "num_profiles": 5})
  with pytest.raises(ValueError):
    s.load_state_dict({"seed": 0, "epoch": 0, "position": 9})
  s.load_state_dict({"seed": 0, "epoch": 2, "position": 4})  # End of epoch: normalised.
  assert (s.epoch, s.position) == (3, 0)
  with pytest.raises(ValueError):
    P.ProfileSampler([])
  with pytest.raises(ValueError):
    s.next_batch(-1)


def test_repeat_for_groups():
  profs = _make(3)
  rep, gid = P.repeat_for_groups(profs, 4)
  assert [p.id for p in rep] == ["p0"] * 4 + ["p1"] * 4 + ["p2"] * 4
  np.testing.assert_array_equal(gid, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
  assert gid.dtype == np.int32
  rep1, gid1 = P.repeat_for_groups(profs, 1)
  assert rep1 == profs and gid1.tolist() == [0, 1, 2]
  with pytest.raises(ValueError):
    P.repeat_for_groups(profs, 0)


def test_split_holdout():
  profs = _make(20)
  train, hold = P.split_holdout(profs, 5, seed=0)
  assert len(train) == 15 and len(hold) == 5
  assert {p.id for p in train}.isdisjoint(p.id for p in hold)
  assert {p.id for p in train} | {p.id for p in hold} == {p.id for p in profs}
  assert P.split_holdout(profs, 5, seed=0) == (train, hold)
  assert P.split_holdout(profs, 5, seed=1)[1] != hold
  order = [p.id for p in profs]
  assert [order.index(p.id) for p in hold] == sorted(order.index(p.id) for p in hold)
  assert P.split_holdout(profs, 0, seed=0) == (profs, [])
  with pytest.raises(ValueError):
    P.split_holdout(profs, 21, seed=0)


# --- gs:// against a local emulator -------------------------------------------------------------

def _free_port() -> int:
  import socket
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


@pytest.fixture
def gcs_emulator(monkeypatch):
  emulator = pytest.importorskip("gcp_storage_emulator.server",
                                 reason="gcp-storage-emulator not installed")
  port = _free_port()
  server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket="profiles")
  server.start()
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
  try:
    yield P._gcs_client()
  finally:
    server.stop()


def test_load_from_gcs_emulator(gcs_emulator):
  lines = [json.dumps(_row(0)), "", json.dumps(_row(1, first_talk="hello"))]
  gcs_emulator.bucket("profiles").blob("dir/p.jsonl").upload_from_string("\n".join(lines))
  got = P.load_profiles("gs://profiles/dir/p.jsonl")
  assert [p.id for p in got] == ["p0", "p1"] and got[1].first_talk == "hello"

  gcs_emulator.bucket("profiles").blob("bad.jsonl").upload_from_string(
      json.dumps(_row(0)) + "\n{oops\n")
  with pytest.raises(P.ProfileError, match=r"^gs://profiles/bad\.jsonl:2: invalid JSON"):
    P.load_profiles("gs://profiles/bad.jsonl")

  with pytest.raises(P.ProfileFileNotFound, match="^gs://profiles/missing.jsonl: profile file"):
    P.load_profiles("gs://profiles/missing.jsonl")
