"""Tiny random Hugging Face checkpoints (transformers + torch, fp32) for parity tests."""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np


def make_hf_model(*, arch: str = "qwen2", tied: bool = False, heads: int = 4, kv_heads: int = 2,
                  hidden: int = 48, intermediate: int = 80, layers: int = 2, vocab: int = 96,
                  head_dim: int | None = None, rope_theta: float = 1e4, std: float = 0.1, eos: int = 2,
                  seed: int = 0):
  """A randomised transformers model in eval mode: weights ~ N(0, std), norm weights ~ 1 + N(0, std).

  arch "qwen2" has q/k/v biases, "llama" none; `head_dim` (llama only) may differ from hidden / heads.
  """
  import torch
  import transformers

  common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                rope_theta=rope_theta, tie_word_embeddings=tied, max_position_embeddings=256,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=eos, pad_token_id=0)
  if arch == "qwen2":
    if head_dim is not None:
      raise ValueError("transformers' Qwen2 has no head_dim setting")
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
  elif arch == "llama":
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=head_dim, **common))
  else:
    raise ValueError(f"unknown arch {arch!r}")
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = std * torch.randn(p.shape, generator=gen)
      p.copy_(1.0 + noise if "norm" in name else noise)
  return model.eval()


def make_hf_checkpoint(path, *, max_shard_size: str | None = None, **kwargs):
  """Saves `make_hf_model(**kwargs)` to `path` (sharded with an index when max_shard_size is small)."""
  model = make_hf_model(**kwargs)
  model.save_pretrained(pathlib.Path(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
  return model


@dataclasses.dataclass(frozen=True)
class Case:
  """One parity configuration; `kwargs` go to `make_hf_checkpoint`."""
  arch: str
  tied: bool
  kv_heads: int
  rope_theta: float
  head_dim: int | None = None
  max_shard_size: str | None = None

  @property
  def id(self) -> str:
    return (f"{self.arch}-{'tied' if self.tied else 'untied'}-kv{self.kv_heads}"
            f"{'-sharded' if self.max_shard_size else ''}")

  @property
  def kwargs(self) -> dict:
    return dict(arch=self.arch, tied=self.tied, kv_heads=self.kv_heads, rope_theta=self.rope_theta,
                head_dim=self.head_dim, max_shard_size=self.max_shard_size)


# Varied: 1 KV head (MQA), GQA and MHA; tied and untied; biases (qwen2) and none (llama); head_dim != D/H.
CASES = (
    Case("qwen2", tied=False, kv_heads=1, rope_theta=1e6, max_shard_size="30KB"),
    Case("qwen2", tied=True, kv_heads=2, rope_theta=1e4),
    Case("llama", tied=False, kv_heads=4, rope_theta=500.0, head_dim=16),
    Case("llama", tied=True, kv_heads=2, rope_theta=1e5),
)


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()
