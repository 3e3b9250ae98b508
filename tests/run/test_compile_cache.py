"""The persistent compilation cache (`compile_cache_dir`): a run stores its compiled programs under
its workdir by default, and a second run in a fresh process reads them back instead of compiling."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

import tiny_world
from config_files import load_config
from rlver_jax.run import compile_cache
from rlver_jax.spec import ConfigError, EvaluationSpec, RunSpec

REPO = pathlib.Path(__file__).resolve().parents[2]


def _entries(folder: pathlib.Path) -> set[str]:
  return {p.name for p in folder.glob("*-cache")}


def _train(world, workdir, *extra) -> int:
  """Trains one tiny step in a fresh process; returns its persistent-cache hits (JAX logs each
  under JAX_LOG_COMPILES). Every program is stored, not only those compiling for over JAX's 1 s
  default, so a run that stores nothing new compiled nothing: each program came from the cache."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_LOG_COMPILES="1", PYTHONPATH=str(REPO / "tests" / "fixtures"))
  proc = subprocess.run([sys.executable, "-m", "rlver_jax.main",
                         *tiny_world.cli_flags(world, "grpo", str(workdir), 1), *extra],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stderr.count("Persistent compilation cache hit")


def test_a_second_run_reads_the_first_runs_programs(tmp_path):
  world = tiny_world.make_world(tmp_path / "world")
  first, second = tmp_path / "first", tmp_path / "second"
  _train(world, first)  # (it reads back its own programs compiled twice: trainers jit anew)
  cache = first / compile_cache.FOLDER
  stored = _entries(cache)
  assert len(stored) >= 10  # decode, append, log-prob and update programs, and smaller ones
  saved = json.loads((first / "config.json").read_text())
  assert saved["compile_cache_dir"] == "{workdir}/compile_cache"
  hits = _train(world, second, f"--config.compile_cache_dir={cache}")
  assert hits >= len(stored)  # each stored program read back (some more than once) ...
  assert _entries(cache) == stored  # ... and none compiled
  assert not (second / compile_cache.FOLDER).exists()
  assert json.loads((second / "config.json").read_text())["compile_cache_dir"] == str(cache)
  # The same run with the cache off compiles and stores nothing anywhere.
  assert _train(world, tmp_path / "third", "--config.compile_cache_dir=") == 0
  assert _entries(cache) == stored and not (tmp_path / "third" / compile_cache.FOLDER).exists()


def test_the_setting():
  assert compile_cache.resolve("{workdir}/compile_cache", "gs://b/runs/r/") == \
      "gs://b/runs/r/compile_cache"
  assert compile_cache.resolve("~/c", "w") == os.path.expanduser("~/c")
  assert compile_cache.resolve("", "w") == ""
  assert EvaluationSpec.from_config(load_config("eval_sentient")).compile_cache_dir == \
      "{workdir}/compile_cache"
  c = load_config("grpo_think")
  c.compile_cache_dir = "{run}/cache"
  with pytest.raises(ConfigError, match=r"config.compile_cache_dir='{run}/cache': must be a folder"):
    RunSpec.from_config(c)
