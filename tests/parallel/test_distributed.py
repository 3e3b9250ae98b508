"""Multi-host start-up on a TPU VM: found by its chips, not by environment variables it lacks."""
from types import SimpleNamespace

import pytest

from rlver_jax.parallel import distributed


@pytest.fixture
def calls(monkeypatch):
  for flag in ("_CPU_DEVICES", "_COORDINATOR"):  # flags left at their defaults, without parsing
    monkeypatch.setattr(distributed, flag, SimpleNamespace(value=None))
  for name in ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "CLOUD_TPU_TASK_ID", "JAX_PLATFORMS"):
    monkeypatch.delenv(name, raising=False)
  seen = []
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda *a, **k: seen.append((a, k)))
  return seen


def test_tpu_chips_on_the_pci_bus_start_the_distributed_system(calls, monkeypatch):
  from jax._src import hardware_utils
  monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, None))
  distributed.initialize()
  assert calls == [((), {})]  # jax finds the slice itself (metadata server)


def test_no_chips_no_variables_no_distributed_system(calls, monkeypatch):
  from jax._src import hardware_utils
  monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
  distributed.initialize()
  assert calls == []


def test_a_cpu_only_process_on_a_tpu_vm_stays_single(calls, monkeypatch):
  from jax._src import hardware_utils
  monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, None))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  distributed.initialize()
  assert calls == []
