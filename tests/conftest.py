"""Test-wide setup: CPU only, 8 fake devices (before jax is imported) so sharding tests can build meshes."""
import os
import pathlib

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import sys  # noqa: E402

import pytest  # noqa: E402

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
