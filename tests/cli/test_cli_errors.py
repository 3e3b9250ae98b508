"""Entry points: a problem we named is one line; a ValueError raised inside a library keeps its traceback."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from rlver_jax.cli.errors import exit_on, raised_here
from rlver_jax.run.saved_config import ConfigConflictError, check_workdir_config

REPO = pathlib.Path(__file__).resolve().parents[2]


def _ours(tmp_path):
  (tmp_path / "config.json").write_text("[1]")
  with pytest.raises(ConfigConflictError) as e:
    check_workdir_config({"a": 1}, str(tmp_path))
  return e.value


def _library():
  with pytest.raises(ValueError) as e:
    json.loads("{")  # raised in the json package's Python code
  return e.value


def test_our_errors_are_told_apart_from_a_librarys(tmp_path):
  assert raised_here(_ours(tmp_path))
  assert not raised_here(_library())


def test_exit_on_prints_a_traceback_only_for_a_library_error(tmp_path, capsys):
  with pytest.raises(SystemExit) as out:
    exit_on(_library())
  assert str(out.value.code).startswith("error: Expecting property name")
  assert "Traceback" in capsys.readouterr().err
  with pytest.raises(SystemExit) as out:
    exit_on(_ours(tmp_path), prefix="aot: error")
  assert str(out.value.code).startswith("aot: error: ") and "config.json" in str(out.value.code)
  assert "Traceback" not in capsys.readouterr().err


def test_workdir_problems_name_the_flag(tmp_path):
  from rlver_jax.run.workdir import check_workdir
  afile = tmp_path / "f"
  afile.write_text("x")
  for workdir, message in ((afile, "exists and is not a directory"),
                           (afile / "sub", "cannot be created"),
                           ("/proc", "is not writable"),  # a directory nobody may write, even root
                           ("/proc/run", "cannot be created")):
    with pytest.raises(ValueError, match=re.escape(f"--workdir={workdir}: {message}")):
      check_workdir(str(workdir))
  check_workdir(str(tmp_path / "new" / "run"))  # made, and left empty
  assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())


def test_a_mistyped_config_argument_is_one_line():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "rlver_jax.main", "--config=configs/grpo_think.py:runloca"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert lines[0].startswith("error: --config=configs/grpo_think.py:runloca: ") and \
      "known: runlocal" in lines[0] and "runloca'" in lines[0]


def test_a_mistyped_config_key_is_one_plain_line_with_the_suggestion(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "rlver_jax.main", "--config=configs/grpo_think.py:runlocal",
                         f"--workdir={tmp_path / 'run'}", "--config.total_step=3"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.splitlines() == [
      "error: --config.total_step: no such config key 'total_step'; did you mean \"total_steps\" "
      "instead of \"total_step\"?"], proc.stderr


@pytest.mark.parametrize("command,flag", [
    (["-m", "rlver_jax.generate", "--prompt=hi"], "--checkpoint"),
    (["-m", "rlver_jax.evaluate", "--config=configs/eval_sentient.py:runlocal"], "--config.policy.checkpoint"),
])
def test_a_training_workdir_given_as_a_model_points_to_export(tmp_path, command, flag):
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "2").mkdir(parents=True)
  (workdir / "config.json").write_text('{"rl": {}, "policy": {}}')  # the run's config, not a model's
  extra = [f"--workdir={tmp_path / 'eval'}"] if "rlver_jax.evaluate" in command else []
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, *command, f"{flag}={workdir}", *extra], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.splitlines() == [
      f"error: {flag}={workdir}: is a training workdir, not a Hugging Face checkpoint; export its "
      f"policy first (python -m rlver_jax.export --workdir={workdir} --out=HF_DIR) and pass "
      f"{flag}=HF_DIR"], proc.stderr


def test_zero_total_steps_is_a_config_error(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "rlver_jax.main", "--config=configs/grpo_think.py:runlocal",
                         f"--workdir={tmp_path / 'run'}", "--config.total_steps=0"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1 and proc.stdout == "", proc.stdout
  assert proc.stderr.strip().splitlines() == [
      "error: config.total_steps=0: must be >= 1 (the step the run trains up to, resumed steps "
      "included)"], proc.stderr
  assert list((tmp_path / "run").iterdir()) == []  # nothing written


def test_a_gcs_workdir_is_checked_too(monkeypatch):
  pytest.importorskip("gcp_storage_emulator")
  pytest.importorskip("gcsfs")
  import gcs_emulator
  from rlver_jax.run.workdir import check_workdir
  from rlver_jax.models.io import storage
  with gcs_emulator.running("rlver-check") as url:
    for k, v in gcs_emulator.env(url).items():
      monkeypatch.setenv(k, v)
    for k in gcs_emulator.DERIVED_ENV:  # set by the next call; undone after the test with the rest
      monkeypatch.delenv(k, raising=False)
    storage.point_clients_at_emulator()
    check_workdir("gs://rlver-check/runs/x")
    assert gcs_emulator.names(gcs_emulator.client(url), "gs://rlver-check/runs") == []  # probe removed
    with pytest.raises(ValueError, match=r"^--workdir=gs://no-such-bucket-here/x: (cannot be created|is not writable)"):
      check_workdir("gs://no-such-bucket-here/x")
    from etils import epath
    epath.Path("gs://rlver-check/models/m/config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^--workdir=gs://rlver-check/models/m: holds files but is not "
                       r"a run's workdir \(config\.json\)"):
      check_workdir("gs://rlver-check/models/m")
