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


_ABSENT = object()


@pytest.mark.parametrize("use,window,max_window_layers", [
    (True, 4096, 2), (True, 4096, 24), (True, 4096, 30), (False, 4096, 0), (True, None, 0),
    (True, _ABSENT, 0), (True, _ABSENT, 20), (False, _ABSENT, 0)])
def test_sliding_layers_agree_with_transformers(use, window, max_window_layers):
  transformers = pytest.importorskip("transformers")
  from rlver_jax.models.presets import _sliding_layers
  fields = dict(use_sliding_window=use, max_window_layers=max_window_layers)
  if window is not _ABSENT:  # absent: transformers' Qwen2Config default applies
    fields["sliding_window"] = window
  hf = transformers.Qwen2Config(num_hidden_layers=24, **fields)
  expected = [i for i, t in enumerate(hf.layer_types) if t == "sliding_attention"]
  # Both with the list transformers 5 writes and without it (a transformers 4 config.json).
  for cfg in (_hf(**fields, layer_types=hf.layer_types), _hf(**fields)):
    layers, ours_window = _sliding_layers(cfg)
    assert layers == expected
    if expected:
      assert ours_window == hf.sliding_window


def test_sliding_window_on_without_a_window_key_is_refused():
  # transformers then uses Qwen2Config's default window, so full attention would differ past it.
  cfg = _hf(use_sliding_window=True, max_window_layers=0)
  assert "sliding_window" not in cfg
  with pytest.raises(ValueError, match="sliding-window attention .*window 4096"):
    from_hf_config(cfg)


def test_llama_ignores_window_keys_like_transformers():
  # transformers' Llama has no sliding window: these keys change nothing there, nor here.
  cfg = _hf(model_type="llama", use_sliding_window=True, sliding_window=16, max_window_layers=0)
  assert from_hf_config(cfg).qkv_bias is False


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads"])
def test_missing_required_key_names_file_and_key(key):
  cfg = _hf()
  del cfg[key]
  with pytest.raises(ValueError, match=rf"^/ckpt/config\.json: required key '{key}' is missing$"):
    from_hf_config(cfg, source="/ckpt/config.json")
