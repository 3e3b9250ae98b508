"""Qwen2-family models: architecture, presets, sharded creation and Hugging Face checkpoint I/O.

`load_pretrained(path, dtype=jnp.bfloat16, mesh=None) -> (model, config)`; `model(input_ids)` gives
logits [batch, length, vocab]. Tokenizers live in `rlver_jax.models.tokenizer` and the embedded
SmolLM2 checkpoint in `rlver_jax.models.embedded` (not imported here: they pull in transformers);
checkpoint I/O (HF, safetensors, gs://) in `io/`.

May import: parallel. The model knows nothing of sampling, dialogues or losses (a cached forward
pass reads its cache through the `qwen2.LayerCache` protocol that `sampling.kv_cache` implements).
"""
import os

# transformers serves here for tokenizers and config files only, and torch is not installed with this
# package (the parity tests' torch lives in its own venv): without torch, importing transformers prints
# "PyTorch was not found..." on every entry point. That is its one advisory warning, and this its switch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from rlver_jax.models.factory import create_model  # noqa: E402
from rlver_jax.models.io.hf import export_pretrained, load_pretrained  # noqa: E402
from rlver_jax.models.presets import Qwen2Config, from_hf_config, get_preset  # noqa: E402
from rlver_jax.models.qwen2 import Qwen2  # noqa: E402

__all__ = ["Qwen2", "Qwen2Config", "create_model", "export_pretrained", "from_hf_config", "get_preset",
           "load_pretrained"]
