"""Test-wide setup: CPU only, 8 fake devices (before jax is imported) so sharding tests can build meshes."""
import os
import pathlib

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import atexit  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Every Trainer jits its update step and old-log-prob pass anew (bound methods), so each tiny-world
# run in a test process compiled the same programs again (~6 s a run). A persistent cache of this
# process's own compilations makes each program compile once. It is set in-process only (not in
# the environment): subprocess runs (CLI, multi-host, kill tests) compile as a user's run does.
_XLA_CACHE = tempfile.mkdtemp(prefix="rlver_jax_test_xla_")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the tiny model's are ~0.1-5 s
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

REPO = pathlib.Path(__file__).resolve().parents[1]
# Shared helpers (the tiny world, the GCS emulator, HF checkpoint builders) live in tests/fixtures;
# tests in every folder import them by module name.
sys.path.insert(0, str(REPO / "tests" / "fixtures"))
SHARED = REPO.parent / "shared"


@pytest.fixture
def shared_dir() -> pathlib.Path:
  if not SHARED.is_dir():
    pytest.skip(f"{SHARED} is not present (the project's shared/ folder sits beside the repository)")
  return SHARED


def _memory_maps() -> tuple[int, int] | None:
  """(this process's memory mappings, the kernel's limit per process), where Linux tells."""
  try:
    with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
      return sum(1 for _ in maps), int(limit.read())
  except OSError:
    return None


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """Frees the compiled programs a test left in jax's caches once they hold 40% of the mappings a
  process may have. Each XLA:CPU executable keeps a few memory mappings of JIT'd code, and an xdist
  worker compiles thousands (every Trainer jits its programs anew) and keeps them: a worker reached
  ~20k of the 65,530 by mid-suite. At the limit LLVM cannot map a new program ("LLVM compilation
  error: Cannot allocate memory") and the C++ exception that reports it segfaults in the unwinder
  (_Unwind_Find_FDE, under xla::ValueOrThrow in backend_compile_and_load): the suite's intermittent
  crash compiling the update step, reproduced by filling the mappings first."""
  yield
  maps = _memory_maps()
  if maps is not None and maps[0] > 0.4 * maps[1]:
    jax.clear_caches()
    gc.collect()
