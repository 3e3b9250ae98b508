"""Qwen2-family architecture configs: named Qwen2.5 presets and `from_hf_config` for any config.json."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  """Architecture of one Qwen2-family checkpoint (Qwen2/2.5, and Llama-architecture ones like SmolLM2)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  qkv_bias: bool = True
  max_position_embeddings: int = 32768
  # Token ids from the checkpoint (None where the checkpoint does not name one).
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  checkpoint_dtype: str = "bfloat16"
  initializer_range: float = 0.02  # std of the checkpoint's random init (a new value head's)

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

  def num_params(self, value_head: bool = False) -> int:
    """Parameter count, as Hugging Face counts it (tied embeddings once)."""
    d, f, h, k, dh = (self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads,
                      self.head_dim)
    attn = d * h * dh * 2 + d * k * dh * 2
    if self.qkv_bias:
      attn += h * dh + 2 * k * dh
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_word_embeddings else self.vocab_size * d
    return self.num_layers * layer + self.vocab_size * d + head + d + (d + 1 if value_head else 0)

  def kv_bytes_per_token(self, dtype=jnp.bfloat16) -> int:
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * jnp.dtype(dtype).itemsize


def _qwen25(vocab, d, f, layers, heads, kv, tied, eps=1e-6) -> Qwen2Config:
  return Qwen2Config(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv, head_dim=d // heads, rope_theta=1_000_000.0,
                     rms_norm_eps=eps, tie_word_embeddings=tied, qkv_bias=True,
                     max_position_embeddings=32768, bos_token_id=None,
                     eos_token_id=(151645, 151643), pad_token_id=151643)


# Published config.json values of the Qwen2.5 Instruct checkpoints.
PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-0.5b": _qwen25(151936, 896, 4864, 24, 14, 2, tied=True),
    "qwen2.5-1.5b": _qwen25(151936, 1536, 8960, 28, 12, 2, tied=True),
    "qwen2.5-3b": _qwen25(151936, 2048, 11008, 36, 16, 2, tied=True),
    "qwen2.5-7b": _qwen25(152064, 3584, 18944, 28, 28, 4, tied=False),
    "qwen2.5-14b": _qwen25(152064, 5120, 13824, 48, 40, 8, tied=False),
    "qwen2.5-32b": _qwen25(152064, 5120, 27648, 64, 40, 8, tied=False),
    "qwen2.5-72b": _qwen25(152064, 8192, 29568, 80, 64, 8, tied=False),
}


def get_preset(name: str) -> Qwen2Config:
  key = name.lower().removesuffix("-instruct")
  if key not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
  return PRESETS[key]


def _rope_theta(cfg: dict[str, Any], source: str) -> float:
  # transformers 5.x nests RoPE settings under rope_parameters; 4.x has a top-level rope_theta.
  params = cfg.get("rope_parameters") or {}
  if "rope_theta" in params:
    theta = params["rope_theta"]
  else:
    theta = cfg.get("rope_theta", 10_000.0)
  scaling = cfg.get("rope_scaling") or {}
  rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
  if rope_type != "default":
    raise ValueError(f"{source}: rope type {rope_type!r} is not supported (only 'default' RoPE)")
  return float(theta)


def _sliding_layers(cfg: dict[str, Any]) -> tuple[list[int], int | None]:
  """Layers (and window) that transformers' Qwen2 runs with sliding-window attention for this config.json.

  The window is on only with use_sliding_window; then the layers are those marked in layer_types
  (transformers 5) or, without that list, layers from max_window_layers on (transformers 4).
  """
  if not cfg.get("use_sliding_window"):
    return [], None
  # An absent key means Qwen2Config's default window; only an explicit null turns it off.
  window = cfg.get("sliding_window", _QWEN2_DEFAULT_WINDOW)
  if window is None:
    return [], None
  types = cfg.get("layer_types")
  if types is not None:
    return [i for i, t in enumerate(types) if t == "sliding_attention"], window
  first = cfg.get("max_window_layers", 28)  # transformers' default when the key is absent
  return list(range(first, cfg["num_hidden_layers"])), window


_QWEN2_DEFAULT_WINDOW = 4096  # transformers.Qwen2Config().sliding_window when use_sliding_window is set
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")


def from_hf_config(cfg: dict[str, Any] | str, source: str = "config.json") -> Qwen2Config:
  """Builds a config from a Hugging Face config.json (a dict or a path), transformers 4.x or 5.x.

  `source` names the file in error messages (the path itself when `cfg` is one).
  """
  if isinstance(cfg, str):
    source = cfg
    with open(cfg) as f:
      cfg = json.load(f)
  model_type = cfg.get("model_type")
  if model_type not in ("qwen2", "llama"):
    raise ValueError(f"{source}: model_type {model_type!r} is not a Qwen2-family model "
                     "(expected 'qwen2' or 'llama')")
  for key in _REQUIRED_KEYS:
    if cfg.get(key) is None:
      raise ValueError(f"{source}: required key {key!r} is missing")
  heads = cfg["num_attention_heads"]
  d = cfg["hidden_size"]
  # Qwen2 has q/k/v biases and no o_proj bias; Llama's attention_bias adds all four, and this model
  # has no o_proj bias to load it into.
  if model_type == "llama" and cfg.get("attention_bias"):
    raise ValueError(f"{source}: attention_bias=true (Llama) is not supported: its o_proj bias has "
                     "no place in this model")
  bias = model_type == "qwen2"
  if cfg.get("mlp_bias"):
    raise ValueError(f"{source}: mlp_bias=true is not supported")
  if cfg.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
  # transformers' Llama has no sliding window and ignores these keys; its Qwen2 applies them.
  sliding, window = _sliding_layers(cfg) if model_type == "qwen2" else ([], None)
  if sliding:
    raise ValueError(f"{source}: sliding-window attention (use_sliding_window=true, window "
                     f"{window}) on {len(sliding)} layers is not supported; this "
                     "model attends to the full context")
  eos = cfg.get("eos_token_id")
  dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
  return Qwen2Config(
      vocab_size=cfg["vocab_size"], hidden_size=d, intermediate_size=cfg["intermediate_size"],
      num_layers=cfg["num_hidden_layers"], num_heads=heads,
      num_kv_heads=cfg.get("num_key_value_heads") or heads,
      head_dim=cfg.get("head_dim") or d // heads, rope_theta=_rope_theta(cfg, source),
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
      qkv_bias=bias, max_position_embeddings=cfg.get("max_position_embeddings", 32768),
      bos_token_id=cfg.get("bos_token_id"),
      eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
      pad_token_id=cfg.get("pad_token_id"), checkpoint_dtype=str(dtype),
      initializer_range=float(cfg.get("initializer_range", 0.02)))


def to_hf_config(config: Qwen2Config) -> dict[str, Any]:
  """config.json for export; Qwen2 layout when the checkpoint has q/k/v biases, Llama otherwise."""
  model_type = "qwen2" if config.qkv_bias else "llama"
  out = {
      "architectures": ["Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"],
      "model_type": model_type,
      "vocab_size": config.vocab_size,
      "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": config.rms_norm_eps,
      "rope_theta": config.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
      "tie_word_embeddings": config.tie_word_embeddings,
      "max_position_embeddings": config.max_position_embeddings,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": list(config.eos_token_id) if isinstance(config.eos_token_id, tuple)
                      else config.eos_token_id,
      "pad_token_id": config.pad_token_id,
      "initializer_range": config.initializer_range,
      "dtype": config.checkpoint_dtype,
      "torch_dtype": config.checkpoint_dtype,
  }
  if model_type == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  return out


def param_dtype_of(name: str):
  if name not in _DTYPES:
    raise ValueError(f"unknown dtype {name!r}; known: {', '.join(_DTYPES)}")
  return _DTYPES[name]

