"""Test-wide setup: CPU only, 8 fake devices (before jax is imported) so sharding tests can build meshes."""
import os
import pathlib

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import sys  # noqa: E402

import pytest  # noqa: E402

# No persistent compilation cache in the test processes. One per process (every compile written,
# later Trainers' programs loaded back) saved ~3 min of the suite, but two fresh-clone runs
# segfaulted inside XLA:CPU's compile-and-serialize path of that cache (2026-12-02 in a cache write,
# 2026-12-03 in `_compile_and_write_cache`), the only crashes the suite has had. Subprocess tests that
# set JAX_COMPILATION_CACHE_DIR for their own few programs keep it.

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
