"""The console on a machine without a TPU: jax does not start libtpu (installed with jax[tpu]),
whose failed start prints half a dozen lines, unless the user chose the platforms or asked for a TPU."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from rlver_jax.cli import console

REPO = pathlib.Path(__file__).resolve().parents[2]

def _tpu_attached() -> bool:
  from jax._src import hardware_utils  # jax's own test for a TPU on the PCI bus
  return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0


# What every entry point does first (its flags_parser), then what a run does soon after.
_ENTRY = ("from rlver_jax.cli.flags import parse_flags; parse_flags(['entry']); import jax; "
          "print(sorted({d.platform for d in jax.devices()}))")


def test_no_libtpu_lines_on_a_machine_without_a_tpu():
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed: nothing could print its lines")
  if _tpu_attached():
    pytest.skip("a TPU is attached: libtpu starts here by design")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  proc = subprocess.run([sys.executable, "-c", _ENTRY], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert "cpu" in proc.stdout
  # e.g. "Failed to find host bounds for accelerator type", "=== Source Location Trace: ==="
  assert proc.stderr == ""


@pytest.mark.parametrize("name,value", [("JAX_PLATFORMS", "tpu"), ("JAX_PLATFORMS", ""),
                                        ("TPU_ACCELERATOR_TYPE", "v5p-8"),
                                        ("JAX_FORCE_TPU_INIT", "1")])
def test_platforms_a_user_chose_are_kept(monkeypatch, name, value):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setenv(name, value)
  monkeypatch.setattr(console, "_tpu_visible", lambda: False)
  assert console.skip_absent_tpu() is None
  assert os.environ.get(name) == value


def test_a_tpu_on_this_machine_keeps_jax_defaults(monkeypatch):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setattr(console, "_tpu_visible", lambda: True)
  assert console.skip_absent_tpu() is None and "JAX_PLATFORMS" not in os.environ


def test_without_a_tpu_jax_gets_the_gpus_present_then_the_cpu(monkeypatch):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setattr(console, "_tpu_visible", lambda: False)
  monkeypatch.setattr(console, "_gpu_platforms", lambda: ["cuda"])
  import jax
  before = jax.config.jax_platforms
  try:
    assert console.skip_absent_tpu() == "cuda,cpu" and os.environ["JAX_PLATFORMS"] == "cuda,cpu"
    assert jax.config.jax_platforms == "cuda,cpu"  # jax was imported before: its config is set too
  finally:
    jax.config.update("jax_platforms", before)
