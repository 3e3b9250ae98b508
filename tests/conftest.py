"""Test-wide setup: CPU only, 8 fake devices (before jax is imported) so sharding tests can build meshes,
and the tiny programs' compile flags (`fixtures/compile_flags.py`)."""
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
# Shared helpers (the tiny world, the GCS emulator, HF checkpoint builders) live in tests/fixtures;
# tests in every folder import them by module name.
sys.path.insert(0, str(REPO / "tests" / "fixtures"))

from compile_flags import TINY_PROGRAMS  # noqa: E402

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TINY_PROGRAMS}")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Every trainer and sampler a test builds jits its programs anew, so each tiny-world run in a test
# process compiled the same programs again (~6 s a run). A persistent cache of this process's own
# compilations makes each program compile once. (One cache shared by both xdist workers was slower:
# jax locks a shared folder and scans it on every write, 28:55 for the suite against 23:29.) It is
# set in-process only (not in the environment): subprocess runs (CLI, multi-host, kill tests)
# compile as a user's run does.
_XLA_CACHE = tempfile.mkdtemp(prefix="rlver_jax_test_xla_")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the tiny model's are ~0.1-5 s
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

SHARED = REPO.parent / "shared"

from memory_maps import release_compiled_programs_above  # noqa: E402


@pytest.fixture
def shared_dir() -> pathlib.Path:
  if not SHARED.is_dir():
    pytest.skip(f"{SHARED} is not present (the project's shared/ folder sits beside the repository)")
  return SHARED



@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """Frees the compiled programs a test left in jax's caches once they hold 40% of the memory
  mappings a process may have (`memory_maps.py` says why: the suite's segfault)."""
  yield
  release_compiled_programs_above(0.4)


# The slowest tests (whole runs in subprocesses, multi-host runs, TPU compiles of 7B/72B layers;
# measured with --durations) go first: at the end they left one worker busy for minutes while the
# other idled. With `--dist worksteal` (Makefile) the quick ones then fill the gaps.
SLOW_FIRST = (
    "tests/train/test_runlocal_configs.py",
    "tests/train/test_demo_config.py",
    "tests/parallel/test_multihost.py",
    "tests/train/test_simulator_draft.py",
    "tests/run/test_compile_cache.py",
    "tests/rl/test_packed_update.py",
    "tests/run/test_gcs_workdir.py",
    "tests/train/test_crash_anywhere.py",
    "tests/aot/test_decode_bytes.py",
    "tests/evaluation/test_evaluate_general.py",
    "tests/train/test_checkpoint_failures_cli.py",
    "tests/cli/test_notebooks.py",
    "tests/cli/test_export_cli.py",
)


def pytest_collection_modifyitems(config, items):
  rank = {path: i for i, path in enumerate(SLOW_FIRST)}
  key = lambda item: rank.get(item.nodeid.split("::")[0], len(SLOW_FIRST))
  items.sort(key=key)  # stable: each file keeps its own order
