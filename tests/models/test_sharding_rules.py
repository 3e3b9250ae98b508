"""The logical-axis rules on meshes that do not divide a dimension: replicated, and said so."""
import logging

import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rlver_jax.models import factory
from rlver_jax.models.factory import abstract_model, state_shardings
from rlver_jax.models.presets import get_preset
from rlver_jax.parallel.sharding import DEFAULT_RULES, MeshConfig, make_mesh


def test_an_axis_that_does_not_divide_is_dropped_and_reported():
  mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
  # wq [L, embed, q_heads, head_dim]: 3 heads on tensor=4 stay whole; 64 embed split over fsdp.
  axes, shape = ("layers", "embed", "q_heads", "head_dim"), (2, 64, 3, 16)
  assert DEFAULT_RULES.spec(axes, shape, mesh) == P(None, "fsdp", None, None)
  assert DEFAULT_RULES.dropped(axes, shape, mesh) == [("q_heads", 3, "tensor")]
  assert DEFAULT_RULES.dropped(axes, (2, 64, 8, 16), mesh) == []
  # batch over data x fsdp: 6 rows divide data=2 but not data x fsdp = 8, so fsdp is dropped.
  mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
  assert DEFAULT_RULES.spec(("batch", None), (6, 5), mesh) == P("data", None)
  assert DEFAULT_RULES.dropped(("batch", None), (6, 5), mesh) == [("batch", 6, "fsdp")]


@pytest.mark.parametrize("tensor, expected", [
    (8, {"tensor=8 does not divide kv_heads (4)", "tensor=8 does not divide q_heads (28)"}),
    (4, set()),
])
def test_qwen25_7b_on_a_tensor_axis_that_splits_its_heads_warns(tensor, expected, caplog, monkeypatch):
  monkeypatch.setattr(factory, "_WARNED", set())
  _, state = nnx.split(abstract_model(get_preset("qwen2.5-7b")))
  mesh = make_mesh(MeshConfig(fsdp=8 // tensor, tensor=tensor))
  with caplog.at_level(logging.WARNING):
    shardings = state_shardings(state, mesh)
    state_shardings(state, mesh)  # the critic or simulator of the same shape: no second warning
  warned = [r.getMessage() for r in caplog.records if "does not divide" in r.getMessage()]
  assert {w.split(": ")[1] for w in warned} == expected and len(warned) == len(expected), warned
  if tensor == 8:
    assert any("3 param(s) (719.4M values) replicated over tensor" in w for w in warned)
    assert shardings["layers"]["wq"].get_value().spec == P(None, "fsdp", None, None)  # heads whole
  else:
    assert shardings["layers"]["wq"].get_value().spec == P(None, "fsdp", "tensor", None)
