"""Weights & Biases logging (config.log.wandb_project) in wandb's offline mode: a run's W&B history
holds metrics.jsonl's scalars step by step, the config, the reward plot and the transcripts table;
a resumed workdir continues the same W&B run; a bad project fails the start in one line, a later
W&B failure only warns; with the key empty wandb is never imported."""
import json
import pathlib
import struct
import sys

import pytest

import tiny_world
from rlver_jax.run.metrics import MetricsWriter
from rlver_jax.run.wandb_writer import (RUN_ID_FILE, TRANSCRIPT_COLUMNS, WandbOptions,
                                        WandbStartError)
from rlver_jax.spec import RunSpec
from rlver_jax.spec.sections import ConfigError


@pytest.fixture
def offline(tmp_path, monkeypatch) -> pathlib.Path:
  """WANDB_DIR, with W&B offline (its servers are never contacted)."""
  root = tmp_path / "wandb_dir"
  root.mkdir()
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(root))
  monkeypatch.setenv("WANDB_SILENT", "true")
  return root


def _needs_wandb():
  pytest.importorskip("wandb", reason="needs wandb==0.31.0 (pip install -e '.[wandb]')")


def _records(run_dir: pathlib.Path) -> list:
  """The Record protos of an offline run's run-ID.wandb file: a LevelDB-style log (a 7-byte file
  header, then 32 KiB blocks of chunks: crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
  from wandb.proto import wandb_internal_pb2
  path, = run_dir.glob("run-*.wandb")
  data = path.read_bytes()
  assert data[:4] == b":W&B"
  records, at, chunks = [], 7, b""
  while at + 7 <= len(data):
    if 32768 - at % 32768 < 7:  # a block's tail too short for a chunk header is padding
      at += 32768 - at % 32768
      continue
    _, n, kind = struct.unpack("<IHB", data[at:at + 7])
    chunks += data[at + 7:at + 7 + n]
    at += 7 + n
    if kind in (1, 4):
      records.append(wandb_internal_pb2.Record.FromString(chunks))
      chunks = b""
  return records


def _runs(root: pathlib.Path) -> list[list]:
  return [_records(d) for d in sorted((root / "wandb").glob("offline-run-*"))]


def _history(records) -> dict[int, dict]:
  """step -> {key: value} over the run's history rows (nested keys, as of media, joined by '.')."""
  out: dict[int, dict] = {}
  for r in records:
    if r.WhichOneof("record_type") == "history":
      row = {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
      out.setdefault(row["step"], {}).update(row)
  return out


def _run_record(records):
  return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def test_a_run_logs_its_scalars_config_plot_and_transcripts_to_wandb(offline, tmp_path):
  _needs_wandb()
  world = tiny_world.make_world(tmp_path / "world")
  workdir = tmp_path / "run"
  config = tiny_world.training_config(world, "grpo", total_steps=2, **{
      "eval.every_steps": 1, "data.num_holdout": 1, "eval.num_profiles": 1, "eval.max_turns": 2,
      "log.transcripts_every": 1, "log.wandb_project": "t", "log.wandb_run_name": "tiny"})
  from rlver_jax.train import loop as train
  train.run(RunSpec.from_config(config), str(workdir))
  (records,) = _runs(offline)
  run = _run_record(records)
  assert run.project == "t" and run.display_name == "tiny"
  assert run.run_id == (workdir / RUN_ID_FILE).read_text().strip()
  # The config: what WORKDIR/config.json holds, key by key (W&B adds its own _wandb).
  logged = {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}
  assert logged == json.loads((workdir / "config.json").read_text())

  history = _history(records)
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert sorted(history) == [r["step"] for r in rows] == [1, 2]
  for row in rows:
    scalars = {k: v for k, v in history[row["step"]].items()
               if not k.startswith("_") and "." not in k and not isinstance(v, dict)}
    expected = {k: v for k, v in row.items() if isinstance(v, float) or k == "step"}
    assert "eval/score" in expected and "reward_mean" in expected
    assert scalars == pytest.approx(expected)
    assert history[row["step"]]["eval/emotion_trajectories._type"] == "image-file"
    assert history[row["step"]]["eval/dialogue._type"] == "table-file"
  files, = offline.glob("wandb/offline-run-*/files")
  assert history[2]["reward_plot._type"] == "image-file"
  assert (files / history[2]["reward_plot.path"]).read_bytes().startswith(b"\x89PNG")

  for step in (1, 2):
    assert history[step]["transcripts._type"] == "table-file"
    table = json.loads((files / history[step]["transcripts.path"]).read_text())
    assert table["columns"] == TRANSCRIPT_COLUMNS
    saved = [json.loads(l) for l in
             (workdir / "transcripts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    assert len(table["data"]) == len(saved) == 16  # 2 profiles x groups of 8
    for got, want in zip(table["data"], saved):
      cell = dict(zip(TRANSCRIPT_COLUMNS, got))
      assert (cell["step"], cell["profile_id"], cell["final_emotion"], cell["turns"]) == (
          step, want["profile_id"], want["final_emotion"], len(want["turns"]))
      assert cell["reward"] == pytest.approx(want["reward"])
      assert cell["text"].startswith(f"user: {want['turns'][0]['user']}")
  assert any(r.WhichOneof("record_type") == "artifact" and r.artifact.type == "run_table"
             for r in records)


def test_a_resumed_workdir_continues_the_same_wandb_run(offline, tmp_path):
  _needs_wandb()
  options = WandbOptions("t", config={"seed": 0})
  for step in (1, 2):  # two starts of one run, e.g. before and after a preemption
    writer = MetricsWriter(str(tmp_path / "run"), tensorboard=False, wandb=options)
    writer.write(step, {"reward_mean": 0.5 * step})
    writer.close()
  first, second = _runs(offline)
  assert _run_record(first).run_id == _run_record(second).run_id == (
      tmp_path / "run" / RUN_ID_FILE).read_text().strip()
  assert _history(first)[1]["reward_mean"] == 0.5 and _history(second)[2]["reward_mean"] == 1.0


def test_a_project_wandb_refuses_fails_the_start_in_one_line(offline, tmp_path):
  _needs_wandb()
  with pytest.raises(WandbStartError, match=r"^config.log.wandb_project='a/b': W&B could not start "
                     r"the run \(UsageError: Invalid project name[^\n]*\)$"):
    MetricsWriter(str(tmp_path / "run"), tensorboard=False, wandb=WandbOptions("a/b"))
  assert not (tmp_path / "run" / RUN_ID_FILE).exists()


def test_a_wandb_failure_mid_run_warns_once_and_training_outputs_go_on(offline, tmp_path, caplog):
  _needs_wandb()
  writer = MetricsWriter(str(tmp_path / "run"), tensorboard=False, wandb=WandbOptions("t"))
  calls = []

  def broken(data, *args, **kwargs):
    calls.append(data)
    raise OSError("the W&B service went away")
  writer._wandb._run.log = broken
  with caplog.at_level("WARNING"):
    for step in (1, 2):
      writer.write(step, {"reward_mean": 0.5})
  writer.close()
  warnings = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
  assert len(warnings) == 1 and "step 1" in warnings[0] and "went away" in warnings[0]
  assert len(calls) == 1  # W&B is off after the failure
  assert [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").open()] == [1, 2]


def test_with_the_key_empty_wandb_is_neither_imported_nor_written(offline, tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # any import of wandb now fails
  from rlver_jax.train.trainer import wandb_options
  assert wandb_options(RunSpec.from_config(tiny_world.training_config(
      {"policy": "p", "profiles": "p"}, "grpo"))) is None
  writer = MetricsWriter(str(tmp_path / "run"), tensorboard=False)
  writer.write(1, {"reward_mean": 0.5})
  writer.write_transcripts(1, [])
  writer.plot_rewards()
  writer.close()
  assert not (tmp_path / "run" / RUN_ID_FILE).exists() and not any(offline.iterdir())
  # A project without wandb installed fails with the config, before anything loads.
  with pytest.raises(ConfigError, match=r"log.wandb_project='t'.*pip install 'rlver_jax\[wandb\]'"):
    RunSpec.from_config(tiny_world.training_config({"policy": "p", "profiles": "p"}, "grpo", **{
        "log.wandb_project": "t"}))
