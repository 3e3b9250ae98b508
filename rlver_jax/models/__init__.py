"""Qwen2-family models: architecture, presets, sharded creation and Hugging Face checkpoint I/O.

`load_pretrained(path, dtype=jnp.bfloat16, mesh=None) -> (model, config)`; `model(input_ids)` gives
logits [batch, length, vocab]. Tokenizers live in `rlver_jax.models.tokenizer` and the embedded
SmolLM2 checkpoint in `rlver_jax.models.embedded` (not imported here: they pull in transformers).
"""
from rlver_jax.models.factory import create_model
from rlver_jax.models.hf_io import export_pretrained, load_pretrained
from rlver_jax.models.presets import Qwen2Config, from_hf_config, get_preset
from rlver_jax.models.qwen2 import Qwen2

__all__ = ["Qwen2", "Qwen2Config", "create_model", "export_pretrained", "from_hf_config", "get_preset",
           "load_pretrained"]
