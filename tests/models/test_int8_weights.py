"""int8 weights of a frozen model: hand-computed quantization, the int8 model equal to a float model
holding the dequantized weights, and the loader quantizing each weight in its own sharding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_checkpoints import make_hf_checkpoint
from rlver_jax.models import create_model, load_pretrained
from rlver_jax.models import quant
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.models.qwen2 import param_specs
from rlver_jax.parallel.sharding import MeshConfig, make_mesh


def test_quantize_by_hand():
  # Columns are output channels (input axis 0): scales 1/127 and 4/127.
  w = np.array([[1.0, -1.0, 0.0], [0.25, 4.0, 0.0]], np.float32)
  q, scale = quant.quantize(jnp.asarray(w), (0,))
  np.testing.assert_allclose(np.asarray(scale), [1 / 127, 4 / 127, 0.0], rtol=1e-7)
  np.testing.assert_array_equal(np.asarray(q), [[127, -32, 0], [32, 127, 0]])  # 31.75 -> 32
  assert q.dtype == jnp.int8
  back = np.asarray(quant.dequantize(q, scale, (0,)))
  np.testing.assert_allclose(back, [[1.0, -128 / 127, 0.0], [32 / 127, 4.0, 0.0]], rtol=1e-6)


def _config(tied: bool, bias: bool) -> Qwen2Config:
  return Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, tie_word_embeddings=tied, qkv_bias=bias)


def _dequantized_float_model(model_q, config):
  """A float model whose weights are model_q's int8 weights times their scales."""
  graphdef, _ = nnx.split(create_model(config, dtype=jnp.float32))
  flat = dict(nnx.to_flat_state(nnx.state(model_q)))
  specs = param_specs(config)
  out = []
  for path, spec in specs.items():
    key = tuple(path.split("."))
    value = flat[key].get_value()
    if path in quant.INPUT_AXES:
      scale = flat[key[:-1] + (key[-1] + quant.SCALE_SUFFIX,)].get_value()
      value = quant.dequantize(value, scale, quant.input_dims(path, spec.logical_axes))
    out.append((key, nnx.Param(value, logical_axes=spec.logical_axes)))
  return nnx.merge(graphdef, nnx.from_flat_state(out))


@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)], ids=["tied", "untied-bias"])
def test_int8_model_equals_its_dequantized_float_matmuls(tied, bias):
  config = _config(tied, bias)
  model_q = create_model(config, dtype=jnp.float32, seed=1, init_std=0.3, int8_weights=True)
  state = dict(nnx.to_flat_state(nnx.state(model_q)))
  assert state[("layers", "wq")].get_value().dtype == jnp.int8
  assert state[("layers", "wo_scale")].get_value().shape == (2, 32)       # [L, D]: o_proj's outputs
  assert state[("embed_scale",)].get_value().shape == (64,)                # a scale per vocab row
  assert (("lm_head_scale",) in state) == (not tied)
  ref = _dequantized_float_model(model_q, config)
  ids = jnp.asarray([[5, 9, 1, 33, 60, 2, 7], [3, 3, 3, 0, 0, 0, 0]])
  seg = jnp.asarray([[1] * 7, [1] * 3 + [0] * 4])
  np.testing.assert_allclose(np.asarray(model_q(ids, segment_ids=seg)), np.asarray(ref(ids, segment_ids=seg)),
                             atol=2e-5, rtol=1e-5)
  # ... and the int8 model is a close (not equal) copy of the float one it was quantized from.
  float_model = create_model(config, dtype=jnp.float32, seed=1, init_std=0.3)
  a, b = float_model(ids)[0], model_q(ids)[0]
  assert 0 < float(jnp.abs(a - b).max()) < 0.1 * float(jnp.abs(a).max())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt")
  make_hf_checkpoint(path, arch="qwen2", tied=False, heads=4, kv_heads=2, hidden=48, intermediate=80,
                     vocab=96, std=0.3)
  return str(path)


def test_loader_quantizes_each_weight_in_its_sharding(checkpoint):
  mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2), jax.devices()[:8])
  float_model, config = load_pretrained(checkpoint, dtype=jnp.float32, mesh=mesh)
  model_q, _ = load_pretrained(checkpoint, dtype=jnp.float32, mesh=mesh, int8_weights=True)
  got = dict(nnx.to_flat_state(nnx.state(model_q)))
  want = dict(nnx.to_flat_state(nnx.state(float_model)))
  specs = param_specs(config)
  for path, spec in specs.items():
    key = tuple(path.split("."))
    if path not in quant.INPUT_AXES:  # norms and biases stay float
      np.testing.assert_array_equal(np.asarray(got[key].get_value()), np.asarray(want[key].get_value()))
      continue
    q, scale = got[key].get_value(), got[key[:-1] + (key[-1] + "_scale",)].get_value()
    ref_q, ref_scale = quant.quantize(want[key].get_value(), quant.input_dims(path, spec.logical_axes))
    np.testing.assert_array_equal(np.asarray(q), np.asarray(ref_q))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(ref_scale))
    # The int8 param is sharded as the float one; its scale like the float one's output dims.
    assert q.sharding.spec == want[key].get_value().sharding.spec
    kept = [ax for ax, name in zip(want[key].get_value().sharding.spec, spec.logical_axes)
            if name not in quant.INPUT_AXES[path]]
    assert tuple(scale.sharding.spec) == tuple(kept)[:len(scale.sharding.spec)]
  # Sharded somewhere, so the check above says something: wq's heads over tensor.
  assert "tensor" in tuple(got[("layers", "wq")].get_value().sharding.spec)
