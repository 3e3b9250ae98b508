"""A run never deletes what an earlier run wrote: metrics rows and transcripts past the step it
resumes from (all of them when there is no checkpoint, e.g. checkpoints/ deleted) are moved into
WORKDIR/set_aside/ with one warning saying where; a metrics write that fails names the file, the
step and what is kept, and leaves no temp file."""
import errno
import json
import logging
import pathlib
import shutil
import sys

import pytest

import tiny_world
from rlver_jax.run.metrics import MetricsWriter, NotWritten

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import base  # noqa: E402


def _history(workdir: pathlib.Path, steps) -> MetricsWriter:
  w = MetricsWriter(str(workdir), tensorboard=False)
  for step in steps:
    w.write(step, {"reward_mean": step / 10})
    w.write_transcripts(step, [{"step": step}])
  return w


def _warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_rows_and_transcripts_past_the_resumed_step_are_moved_aside(tmp_path, caplog):
  w = _history(tmp_path, (1, 2, 3))
  with caplog.at_level(logging.WARNING):
    w.drop_after(1)
    w.drop_after(1)  # nothing left to move: no second folder, no second line
  (folder,) = (tmp_path / "set_aside").iterdir()
  assert folder.name.startswith("after_step_1-")
  assert [json.loads(l)["step"] for l in (folder / "metrics.jsonl").read_text().splitlines()] == [2, 3]
  assert sorted(p.name for p in (folder / "transcripts").iterdir()) == [
      "step_000002.jsonl", "step_000003.jsonl"]
  assert [r["step"] for r in w.history()] == [1]
  assert sorted(p.name for p in w.transcripts.iterdir()) == ["step_000001.jsonl"]
  assert _warnings(caplog) == [
      f"2 metrics row(s) and 2 transcript file(s) of step(s) 2-3: the run resumes from the "
      f"checkpoint of step 1 and redoes them; moved them to {folder}"]


def test_a_workdir_whose_checkpoints_were_deleted_keeps_its_history(tmp_path, caplog):
  """The Trainer's resume on a workdir with metrics and transcripts but no checkpoints/ folder."""
  config = base.get_base_config("grpo", think=False, arg=None)
  tiny_world.apply(config, tiny_world.tiny_overrides(tiny_world.make_world(tmp_path / "world"), "grpo"))
  workdir = tmp_path / "run"
  _history(workdir, (1, 2, 3)).close()
  trainer = tiny_world.trainer(config, str(workdir))
  with caplog.at_level(logging.WARNING):
    assert trainer.restore_if_any() is False
  trainer.checkpointer.close()
  trainer.writer.close()
  (folder,) = (workdir / "set_aside").iterdir()
  assert [json.loads(l)["step"] for l in (folder / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
  assert len(list((folder / "transcripts").iterdir())) == 3
  assert not (workdir / "metrics.jsonl").read_text() and not list((workdir / "transcripts").iterdir())
  assert _warnings(caplog) == [
      f"3 metrics row(s) and 3 transcript file(s) of step(s) 1-3: there is no checkpoint to resume "
      f"from, so the run starts over from step 0; moved them to {folder}"]


def test_a_second_set_aside_in_the_same_second_gets_its_own_folder(tmp_path):
  w = _history(tmp_path, (1, 2))
  w.drop_after(0)
  shutil.copy(next((tmp_path / "set_aside").iterdir()) / "metrics.jsonl", w.path)
  w.drop_after(0)
  assert len(list((tmp_path / "set_aside").iterdir())) == 2


def test_a_full_disk_names_the_file_the_step_and_the_last_row_kept(tmp_path, monkeypatch):
  w = _history(tmp_path, (1, 2))
  before = w.path.read_text()
  real = type(w.path).write_text

  def full(self, text, *args, **kwargs):
    real(self, "", *args, **kwargs)  # what a full disk leaves: the file created, nothing in it
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(type(w.path), "write_text", full)
  with pytest.raises(NotWritten) as e:
    w.write(3, {"reward_mean": 0.3})
  assert str(e.value) == (f"could not write the row of step 3 to {w.path} (No space left on device); "
                          "the file is unchanged (its last row: step 2)")
  assert w.path.read_text() == before
  assert not list(tmp_path.glob("*.tmp"))


def test_the_run_adds_the_step_its_checkpoints_still_hold():
  from types import SimpleNamespace
  from rlver_jax.train.loop import _saying_what_is_kept
  for saved, kept in ((2, "the last checkpoint holds step 2"),
                      (None, "there is no checkpoint yet, so the run will start over from step 0")):
    trainer = SimpleNamespace(checkpointer=SimpleNamespace(latest_step=lambda saved=saved: saved))
    with pytest.raises(NotWritten) as e, _saying_what_is_kept(trainer):
      raise NotWritten("could not write the row of step 3 to M (No space left on device)")
    assert str(e.value) == (f"could not write the row of step 3 to M (No space left on device); "
                            f"{kept}; free space and run the same command to resume")


def test_a_gcs_workdir_sets_its_history_aside_too(monkeypatch, caplog):
  pytest.importorskip("gcp_storage_emulator")
  pytest.importorskip("gcsfs")
  import gcs_emulator
  from rlver_jax.models.io import storage
  with gcs_emulator.running("rlver-history") as url:
    for k, v in gcs_emulator.env(url).items():
      monkeypatch.setenv(k, v)
    for k in gcs_emulator.DERIVED_ENV:
      monkeypatch.delenv(k, raising=False)
    storage.point_clients_at_emulator()
    w = _history("gs://rlver-history/run", (1, 2))
    with caplog.at_level(logging.WARNING):
      w.drop_after(1)
    names = gcs_emulator.names(gcs_emulator.client(url), "gs://rlver-history/run")
    assert [r["step"] for r in w.history()] == [1]
    moved = [n for n in names if n.startswith("set_aside/after_step_1-")]
    assert sorted(n.rsplit("/", 1)[1] for n in moved) == ["metrics.jsonl", "step_000002.jsonl"], names
    assert "transcripts/step_000002.jsonl" not in names
    ours = [m for m in _warnings(caplog) if "moved them to" in m]  # gcsfs warns about the emulator
    assert len(ours) == 1 and "gs://rlver-history/run/set_aside/after_step_1-" in ours[0], ours
