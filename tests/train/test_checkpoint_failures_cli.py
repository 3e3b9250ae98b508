"""What the command prints when its checkpoints fail: a disk that fills during a save, then every
checkpoint damaged. Each is exactly one `error:` line on stderr (no library tracebacks, also none
printed as the process ends) and exit status 1; the same command resumes once the cause is gone."""
import pathlib
import re
import subprocess
import sys

import pytest

import tiny_world
from compile_flags import tiny_run_env

REPO = pathlib.Path(__file__).resolve().parents[2]
# The CLI itself, with array writes of step 3's checkpoint failing as on a full disk.
_FULL_AT_STEP_3 = ("import runpy, sys, full_disk; full_disk.fail_writes(where='/checkpoints/3.'); "
                   "sys.argv[0] = 'rlver_jax.main'; runpy.run_module('rlver_jax.main', run_name='__main__')")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


def _main(flags, cache: pathlib.Path, code: str | None = None):
  # The later launches load what the first compiled: this test is about the console, not compiles.
  env = tiny_run_env(cache)
  head = ["-c", code] if code else ["-m", "rlver_jax.main"]
  return subprocess.run([sys.executable, *head, *flags], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=900)


def _damage_all(ckpts: pathlib.Path) -> None:
  """Every array file cut in half, as a copy interrupted or a disk error might leave them."""
  for f in ckpts.glob("*/state/**/d/*"):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def test_disk_full_then_every_checkpoint_damaged_each_print_one_line(world, tmp_path):
  cache, workdir = tmp_path / "xla", tmp_path / "run"
  ckpts = workdir / "checkpoints"
  flags = tiny_world.cli_flags(world, "grpo", str(workdir), 3, **{"checkpoint.every_steps": 1})

  full = _main(flags, cache, _FULL_AT_STEP_3)
  assert full.returncode == 1, full.stderr[-3000:]
  assert full.stderr == (f"error: disk full while saving the checkpoint of step 3 to {ckpts}/3 (No "
                         "space left on device); the checkpoint of step 2 is intact; free space and "
                         "run the same command to resume\n")
  assert sorted(p.name for p in ckpts.iterdir()) == ["1", "2"]  # the half-written step is gone

  resumed = _main(flags, cache)  # space freed: the same command goes on from step 2
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "run finished at step 3" in resumed.stdout
  assert sorted(p.name for p in ckpts.iterdir()) == ["1", "2", "3"]

  _damage_all(ckpts)
  damaged = _main(flags, cache)
  assert damaged.returncode == 1, damaged.stderr[-3000:]
  assert re.fullmatch(
      rf"error: no checkpoint in {ckpts} restores \(tried steps 3, 2, 1; step 3: [A-Z_]+ reading "
      rf'"[^"]+": [^\n]+\); nothing was moved or deleted; to start over from step 0, move {ckpts} '
      rf"away \(e\.g\. to {ckpts}\.damaged\) or pass another --workdir\n", damaged.stderr), \
      damaged.stderr[-3000:]
  assert sorted(p.name for p in ckpts.iterdir()) == ["1", "2", "3"]  # nothing moved
