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
