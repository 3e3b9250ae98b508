"""A workdir is empty or a run's own, and one run at a time holds it (a killed one lets go)."""
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import pytest

from rlver_jax.run.workdir import check_workdir
from rlver_jax.run.workdir_lock import LOCK_FILE, lock_workdir

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_a_folder_of_someone_elses_files_is_refused(tmp_path):
  model = tmp_path / "Qwen2.5-7B"  # an HF checkpoint has a config.json too: not a run's marker
  model.mkdir()
  for name in ("config.json", "model.safetensors", "tokenizer.json", "vocab.json"):
    (model / name).write_text("{}")
  with pytest.raises(ValueError) as e:
    check_workdir(str(model))
  assert str(e.value) == (f"--workdir={model}: holds files but is not a run's workdir (config.json, "
                          "model.safetensors, tokenizer.json and 1 more); use a new or empty directory")
  assert sorted(os.listdir(model)) == ["config.json", "model.safetensors", "tokenizer.json", "vocab.json"]
  notes = tmp_path / "notes"
  (notes / "drafts").mkdir(parents=True)
  with pytest.raises(ValueError, match=re.escape(f"--workdir={notes}: holds files but is not a run's "
                                                 "workdir (drafts)")):
    check_workdir(str(notes))


@pytest.mark.parametrize("left", [
    [],
    [LOCK_FILE],  # a run killed while loading its models: its lock file is the first thing it writes
    ["checkpoints/", "metrics.jsonl", "config.json", "tensorboard/", "notes.txt"],  # a run, resumed
    ["checkpoints/", "tensorboard/"],  # a run older than the lock file, killed while starting
    ["metrics.jsonl.tmp/"],  # a write cut short
    [".write-check-123-host"],  # this check's own probe, killed mid-check
    ["lost+found/"],  # a freshly made filesystem
])
def test_an_empty_or_a_runs_own_workdir_is_taken(tmp_path, left):
  workdir = tmp_path / "w"
  workdir.mkdir()
  for name in left:
    if name.endswith("/"):
      (workdir / name).mkdir()
    else:
      (workdir / name).write_text("")
  check_workdir(str(workdir))


def test_a_second_lock_names_the_holder_and_a_killed_holder_lets_go(tmp_path):
  held = lock_workdir(str(tmp_path))
  try:
    with pytest.raises(ValueError) as e:
      lock_workdir(str(tmp_path))  # another open file: refused like another process
    assert str(e.value) == (f"--workdir={tmp_path}: in use by another run (pid {os.getpid()} on host "
                            f"{socket.gethostname()}); wait for it to end or use another --workdir")
  finally:
    held.release()
  # A holder killed with SIGKILL runs no clean-up: the kernel drops its lock.
  env = dict(os.environ, PYTHONPATH=str(REPO))
  code = (f"from rlver_jax.run.workdir_lock import lock_workdir; l = lock_workdir({str(tmp_path)!r}); "
          "print('locked', flush=True); import time; time.sleep(600)")
  proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(ValueError, match=f"pid {proc.pid} on host"):
      lock_workdir(str(tmp_path))
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  lock_workdir(str(tmp_path)).release()
