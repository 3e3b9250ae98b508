"""config.json reading: which attention biases each architecture gets, and what is refused."""
import dataclasses

import pytest

from rlver_jax.models.presets import from_hf_config, get_preset, to_hf_config


def _hf(**changes):
  cfg = to_hf_config(get_preset("qwen2.5-0.5b"))
  cfg.update(changes)
  return cfg


def test_qwen2_gets_qkv_bias_and_llama_does_not():
  assert from_hf_config(_hf(model_type="qwen2")).qkv_bias is True
  assert from_hf_config(_hf(model_type="llama", attention_bias=False)).qkv_bias is False


def test_llama_attention_bias_is_refused_not_half_loaded():
  # Llama's attention_bias also biases o_proj, which this model cannot hold: loading only q/k/v
  # biases would silently change the outputs.
  with pytest.raises(ValueError, match="attention_bias"):
    from_hf_config(_hf(model_type="llama", attention_bias=True))


def test_round_trip_of_both_layouts():
  qwen = get_preset("qwen2.5-0.5b")
  llama = dataclasses.replace(qwen, qkv_bias=False)  # exported as Llama with attention_bias=false
  for config in (qwen, llama):
    assert from_hf_config(to_hf_config(config)) == config


def test_published_qwen25_window_fields_load():
  # Qwen2.5's own config.json carries the window fields with the window switched off.
  cfg = _hf(use_sliding_window=False, sliding_window=32768, max_window_layers=21)
  assert from_hf_config(cfg) == get_preset("qwen2.5-0.5b")


@pytest.mark.parametrize("fields", [
    dict(use_sliding_window=True, sliding_window=4096, max_window_layers=2),
    dict(use_sliding_window=True, sliding_window=4096, max_window_layers=0),
    dict(use_sliding_window=True, sliding_window=4096,
         layer_types=["full_attention"] * 23 + ["sliding_attention"]),
])
def test_sliding_window_configs_are_refused(fields):
  # Loading these with full attention would silently change every output past the window.
  with pytest.raises(ValueError, match="sliding-window"):
    from_hf_config(_hf(**fields))


@pytest.mark.parametrize("use,window,max_window_layers", [
    (True, 4096, 2), (True, 4096, 24), (True, 4096, 30), (False, 4096, 0), (True, None, 0)])
def test_sliding_layers_agree_with_transformers(use, window, max_window_layers):
  transformers = pytest.importorskip("transformers")
  from rlver_jax.models.presets import _sliding_layers
  fields = dict(use_sliding_window=use, sliding_window=window, max_window_layers=max_window_layers)
  hf = transformers.Qwen2Config(num_hidden_layers=24, **fields).to_dict()
  expected = [i for i, t in enumerate(hf["layer_types"]) if t == "sliding_attention"]
  # Both with the list transformers 5 writes and without it (a transformers 4 config.json).
  assert _sliding_layers(_hf(**fields, layer_types=hf["layer_types"])) == expected
  assert _sliding_layers(_hf(**fields)) == expected
