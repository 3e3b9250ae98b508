"""A run that lives in gs:// end to end, against a local GCS emulator: the policy checkpoint and the
profiles are read from the bucket, and the workdir (config, metrics, transcripts, TensorBoard events,
reward plot, orbax checkpoints) is written there; re-running with more steps resumes from it.

The child processes get only STORAGE_EMULATOR_HOST, as a user would set it; `rlver_jax.main` points
the other GCS clients (tensorstore under orbax, gcsfs under epath) at the same emulator.
"""
import json
import pathlib
import struct
import subprocess
import sys

import pytest

import gcs_emulator
import tiny_world
from compile_flags import tiny_run_env

REPO = pathlib.Path(__file__).resolve().parents[2]
BUCKET = "rlver-test"
TIMEOUT_S = 900  # per run; generous because the CPUs may be shared, still ends a hang

pytest.importorskip("gcp_storage_emulator")
pytest.importorskip("gcsfs")


def _train(url: str, flags: list[str], log: pathlib.Path, cache: pathlib.Path) -> str:
  env = tiny_run_env(JAX_COMPILATION_CACHE_DIR=str(cache), **gcs_emulator.env(url))
  for k in gcs_emulator.DERIVED_ENV:  # derived by the child from STORAGE_EMULATOR_HOST, not inherited
    env.pop(k, None)
  with open(log, "w") as out:
    proc = subprocess.Popen([sys.executable, "-m", "rlver_jax.main", *flags, "--cpu_devices=2"],
                            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
      proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
  text = log.read_text()
  assert proc.returncode == 0, text[-4000:]
  return text


def _scalars(events: bytes, tag: str) -> dict[int, float]:
  """step -> value of one scalar in a TensorBoard events file (TFRecord framing, Event protos)."""
  from tensorboardX.proto import event_pb2
  out, at = {}, 0
  while at < len(events):
    n, = struct.unpack("<Q", events[at:at + 8])
    event = event_pb2.Event.FromString(events[at + 12:at + 12 + n])
    at += 12 + n + 4
    for v in event.summary.value:
      if v.tag == tag:
        out[event.step] = v.simple_value
  return out


def test_train_and_resume_in_gcs(tmp_path):
  world = tiny_world.make_world(tmp_path / "world")
  with gcs_emulator.running(BUCKET) as url:
    gcs = gcs_emulator.client(url)
    gcs_emulator.upload_dir(gcs, pathlib.Path(world["policy"]), f"gs://{BUCKET}/models/tiny")
    gcs.bucket(BUCKET).blob("data/profiles.jsonl").upload_from_filename(world["profiles"])
    remote = {"policy": f"gs://{BUCKET}/models/tiny", "profiles": f"gs://{BUCKET}/data/profiles.jsonl"}
    workdir = f"gs://{BUCKET}/runs/x"
    extra = {"log.transcripts_every": 1}

    first = _train(url, tiny_world.cli_flags(remote, "grpo", workdir, 2, **extra),
                   tmp_path / "first.log", tmp_path / "jax_cache")
    assert "run finished at step 2" in first
    files = gcs_emulator.names(gcs, workdir)
    for name in ("config.json", "metrics.jsonl", "reward.png", "transcripts/step_000001.jsonl",
                 "transcripts/step_000002.jsonl", "checkpoints/2/commit_success.txt"):
      assert name in files, files
    assert [f for f in files if f.startswith("tensorboard/events.out.tfevents.")]
    assert any(f.startswith("checkpoints/2/state/") for f in files)
    before = gcs_emulator.read_text(gcs, f"{workdir}/metrics.jsonl").splitlines()

    second = _train(url, tiny_world.cli_flags(remote, "grpo", workdir, 3, **extra),
                    tmp_path / "second.log", tmp_path / "jax_cache")
    assert "resumed from step 2" in second
    files = gcs_emulator.names(gcs, workdir)
    assert "checkpoints/3/commit_success.txt" in files and "transcripts/step_000003.jsonl" in files
    lines = gcs_emulator.read_text(gcs, f"{workdir}/metrics.jsonl").splitlines()
    assert [json.loads(l)["step"] for l in lines] == [1, 2, 3]
    # One events file per run; TensorBoard reads them as one series.
    events = sorted(f for f in files if f.startswith("tensorboard/events.out.tfevents."))
    assert len(events) == 2
    rewards = {}
    for name in events:
      blob = gcs.bucket(BUCKET).blob(f"runs/x/{name}")
      rewards.update(_scalars(blob.download_as_bytes(), "reward_mean"))
    assert rewards == pytest.approx({json.loads(l)["step"]: json.loads(l)["reward_mean"]
                                     for l in lines})
    assert lines[:2] == before  # steps 1 and 2 were restored, not trained again
    saved = json.loads(gcs_emulator.read_text(gcs, f"{workdir}/config.json"))
    assert saved["total_steps"] == 3 and saved["policy"]["checkpoint"] == remote["policy"]
