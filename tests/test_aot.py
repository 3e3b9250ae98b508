"""AOT compilation for TPU topologies on this CPU machine (needs libtpu; skipped without it).

libtpu describes any TPU slice without a TPU and without initialising a TPU backend, so this runs in the
test process itself, next to JAX_PLATFORMS=cpu and the fake CPU devices.
"""
import importlib.util
import pathlib
import runpy
import sys

import pytest

if importlib.util.find_spec("libtpu") is None:
  pytest.skip('libtpu is not installed (pip install "jax[tpu]==0.10.2")', allow_module_level=True)

from rlver_jax import aot  # noqa: E402
from rlver_jax.aot_programs import model_config  # noqa: E402

_REPO = pathlib.Path(__file__).resolve().parents[1]
_GET_CONFIG = runpy.run_path(str(_REPO / "configs" / "aot_forward.py"))["get_config"]


@pytest.fixture(scope="module")
def topology_ok():
  try:
    aot.get_topology("v5e:2x2")
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"libtpu cannot describe TPU topologies here: {e}")


def _tiny(batch_size=8, seq_len=128):
  config = _GET_CONFIG("tiny")
  with config.unlocked():
    config.forward.batch_size = batch_size
    config.forward.seq_len = seq_len
  return config


def _expected_argument_bytes(config, fsdp: int) -> int:
  """Per-device bytes of bf16 params + int32 ids; every weight with a hidden-size dim is split fsdp ways."""
  c = model_config(config.model)
  L, D, H, K, Dh, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                          c.intermediate_size, c.vocab_size)
  assert D % fsdp == 0 and not c.tie_word_embeddings
  split = L * (2 * D * H * Dh + 2 * D * K * Dh + 3 * D * F) + 2 * V * D   # weights, embedding, LM head
  whole = L * (2 * D + H * Dh + 2 * K * Dh) + D                          # norms and q/k/v biases
  ids = config.forward.batch_size * config.forward.seq_len * 4 // fsdp
  return 2 * (split // fsdp + whole) + ids


def test_forward_fits_and_counts_params(topology_ok):
  config = _tiny()
  (row,) = aot.report(config, "v5e:2x2")
  assert row.program == "forward" and row.mesh == (1, 4, 1)
  assert row.fits and row.error is None
  assert row.argument_bytes == pytest.approx(_expected_argument_bytes(config, fsdp=4), rel=0.01)
  vocab = model_config(config.model).vocab_size
  assert row.output_bytes == 8 * 128 * vocab * 4 // 4   # fp32 logits, batch split 4 ways
  assert row.hbm_bytes == 16 * 2**30
  assert "| forward | v5e:2x2 | 1x4x1 |" in aot.format_table([row])


def test_over_budget_is_a_row_not_a_crash(topology_ok):
  (row,) = aot.report(_tiny(batch_size=64, seq_len=8192), "v5e:1x1")
  assert not row.fits
  assert "RESOURCE_EXHAUSTED" in row.error
  assert row.total_bytes is None
  assert "| no (RESOURCE_EXHAUSTED" in aot.format_table([row])


def test_find_smallest_returns_first_candidate(topology_ok):
  found = aot.find_smallest(_tiny(), families=("v5e",), log=lambda _: None)
  assert found["v5e"].topology == aot.CANDIDATES["v5e"][0]
  assert found["v5e"].rows[0].fits


def test_mesh_falls_back_to_fsdp_when_it_does_not_divide():
  assert aot.fitting_mesh(aot.MeshConfig(1, -1, 8), 4) == aot.MeshConfig(1, -1, 1)
  assert aot.fitting_mesh(aot.MeshConfig(1, -1, 2), 4) == aot.MeshConfig(1, -1, 2)


def test_unknown_topology_is_a_one_line_error(topology_ok):
  with pytest.raises(aot.AotError, match="invalid TPU topology 'v9z:2x2'"):
    aot.get_topology("v9z:2x2")
  with pytest.raises(aot.AotError, match="invalid TPU topology 'nonsense'"):
    aot.get_topology("nonsense")


def test_missing_libtpu_is_a_one_line_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "libtpu", None)   # makes `import libtpu` raise ImportError
  monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
  with pytest.raises(aot.AotError, match=r'pip install "jax\[tpu\]==0.10.2"'):
    aot.get_topology("v5e:2x2")
