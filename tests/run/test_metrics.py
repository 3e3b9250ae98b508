"""metrics.jsonl: one row per step, later rows dropped on a resume, evaluation merged into its row,
and a last line cut short is set aside once (the rows before it kept)."""
import json
import logging

import pytest

from rlver_jax.run.metrics import MetricsWriter


def _rows(path):
  return [json.loads(l) for l in path.read_text().splitlines()]


def test_rows_resume_and_merge(tmp_path):
  w = MetricsWriter(str(tmp_path), tensorboard=False)
  for step in (1, 2, 3):
    w.write(step, {"reward_mean": step / 10})
  w.write(2, {"reward_mean": 0.5})  # a resumed run redoes step 2: step 3's row goes
  w.write(2, {"eval/score": 40.0}, merge=True)
  assert _rows(w.path) == [{"step": 1, "reward_mean": 0.1},
                           {"step": 2, "eval/score": 40.0, "reward_mean": 0.5}]
  assert not list(tmp_path.glob("*.tmp"))  # written through a renamed temp file


def test_a_cut_off_last_line_is_set_aside_once_with_one_warning(tmp_path, caplog):
  w = MetricsWriter(str(tmp_path), tensorboard=False)
  w.write(1, {"reward_mean": 0.1})
  w.write(2, {"reward_mean": 0.2})
  with open(w.path, "a") as f:
    f.write('{"step": 3, "reward_me')  # a copy cut short, or an older in-place writer killed
  with caplog.at_level(logging.WARNING):
    resumed = MetricsWriter(str(tmp_path), tensorboard=False)  # what the next run opens
    assert [r["step"] for r in resumed.history()] == [1, 2]
    resumed.write(3, {"reward_mean": 0.3})
    MetricsWriter(str(tmp_path), tensorboard=False).history()  # the summary's reader
  assert [r["step"] for r in _rows(w.path)] == [1, 2, 3]
  (aside,) = (tmp_path / "set_aside").glob("cut_line-*/metrics.jsonl")
  assert aside.read_text() == '{"step": 3, "reward_me\n'
  warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert warned == [f"{w.path}: its last line (step 3) is cut short (Unterminated string starting "
                    f"at): moved it to {aside}, the 2 row(s) before it are kept"]


def test_a_broken_line_inside_the_file_names_it(tmp_path):
  w = MetricsWriter(str(tmp_path), tensorboard=False)
  w.path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
  with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON metrics line"):
    w.write(4, {"reward_mean": 0.1})
  assert w.path.read_text() == '{"step": 1}\nnot json\n{"step": 3}\n'  # left as it was


def _events(directory):
  """Every Event proto of the TensorBoard files in `directory`, file by file in time order."""
  import struct
  from tensorboardX.proto import event_pb2
  out = []
  for path in sorted(directory.iterdir()):
    data, at = path.read_bytes(), 0
    while at < len(data):
      n, = struct.unpack("<Q", data[at:at + 8])
      out.append(event_pb2.Event.FromString(data[at + 12:at + 12 + n]))
      at += 12 + n + 4
  return out


def test_a_resume_purges_the_redone_steps_from_tensorboard(tmp_path):
  w = MetricsWriter(str(tmp_path))
  for step in (1, 2, 3):
    w.write(step, {"reward_mean": step / 10})
  w.close()
  import time
  time.sleep(1.1)  # event file names carry the second they were opened
  resumed = MetricsWriter(str(tmp_path))  # the checkpoint was at step 1: steps 2 and 3 are redone
  resumed.write(2, {"reward_mean": 0.5})
  resumed.close()
  events = _events(tmp_path / "tensorboard")
  starts = [e for e in events if e.HasField("session_log")]
  assert starts and starts[-1].session_log.status == starts[-1].session_log.START
  assert starts[-1].step == 2  # TensorBoard hides every earlier event from step 2 on
