"""Model shapes the benchmarks build with random weights: the Qwen2.5 presets, SmolLM2-135M, a tiny one."""
from __future__ import annotations

from rlver_jax.models.presets import PRESETS, Qwen2Config

# Published config.json values of SmolLM2-135M(-Instruct) (Llama architecture, tied embeddings).
SMOLLM2_135M = Qwen2Config(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                           num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100_000.0,
                           rms_norm_eps=1e-5, tie_word_embeddings=True, qkv_bias=False,
                           max_position_embeddings=8192, bos_token_id=1, eos_token_id=(2,),
                           pad_token_id=2)
TINY = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rope_theta=10_000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, qkv_bias=True, max_position_embeddings=1024,
                   bos_token_id=None, eos_token_id=(1,), pad_token_id=0)


def shape_config(name: str) -> Qwen2Config:
  """"tiny", "smollm2-135m" or a Qwen2.5 preset name."""
  shapes = {"tiny": TINY, "smollm2-135m": SMOLLM2_135M, **PRESETS}
  if name not in shapes:
    raise ValueError(f"unknown shape {name!r}; known: {', '.join(shapes)}")
  return shapes[name]
