"""google-tunix's native JAX sampler as a decode peer for `decode_throughput.py --peers tunix`.

The same embedded SmolLM2 safetensors load into tunix's Llama3 model (SmolLM2 is a Llama: plain RoPE,
tied embeddings), fp32, and its `Sampler` decodes the same prompt token ids: a tokenizer of tunix's
duck-typed protocol hands back the prepared ids for each row's key, so nothing is re-tokenized.
EOS is an id no model emits, so every row decodes exactly `new` tokens, as on the other sides.
tunix compiles per temperature (a static argument there), so callers warm each mode up first.

Needs the benchmark-only environment (`make bench-tunix-env`, `benchmarks/requirements-tunix.txt`).
"""
from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np

from _common import timed

NEVER = -1  # an "end of sequence" id outside the vocabulary: rows never stop early


class PreparedIds:
  """tunix's tokenizer protocol over fixed rows: encode("row3") returns row 3's token ids."""

  def __init__(self, rows: np.ndarray, pad_id: int):
    self.rows = {f"row{i}": [int(t) for t in r] for i, r in enumerate(rows)}
    self._pad = pad_id

  def encode(self, text: str, **_) -> list[int]:
    return self.rows[text]

  def decode(self, ids, **_) -> str:
    return ""  # the benchmark reads the token ids, never the text

  def bos_id(self):
    return None  # no BOS added: the prompts are complete chat prompts

  def eos_id(self) -> int:
    return NEVER

  def pad_id(self) -> int:
    return self._pad


def llama_config(path: str):
  """tunix's Llama3 ModelConfig from a Hugging Face config.json."""
  from tunix.models.llama3 import model as llama
  c = json.loads((pathlib.Path(path) / "config.json").read_text())
  heads = c["num_attention_heads"]
  return llama.ModelConfig(
      num_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"], embed_dim=c["hidden_size"],
      hidden_dim=c["intermediate_size"], num_heads=heads, head_dim=c.get("head_dim", c["hidden_size"] // heads),
      num_kv_heads=c["num_key_value_heads"], rope_theta=int(c["rope_theta"]), norm_eps=c["rms_norm_eps"],
      weight_tying=bool(c.get("tie_word_embeddings", False)))


def _use_config_rope_theta(theta: int) -> None:
  """tunix 0.1.7's Llama3 attention calls `apply_rope` without the config's `rope_theta`, so every
  model runs at its default base (1e6; SmolLM2 has 1e5) and decodes other tokens than the checkpoint
  does. Binding the config's value makes the outputs comparable; the work per step is unchanged."""
  import functools

  from tunix.models.llama3 import model as llama
  original = getattr(llama.apply_rope, "func", llama.apply_rope)
  llama.apply_rope = functools.partial(original, rope_theta=theta)


class Tunix:
  """tunix's Sampler on the given prompts, `new` tokens per row, fp32."""

  def __init__(self, path: str, prompts: np.ndarray, new: int):
    from tunix.generate.sampler import CacheConfig, Sampler
    from tunix.models.llama3 import params as llama_params
    cfg = llama_config(path)
    # tunix masks every token equal to its pad id, prompt or sampled, so the pad cannot be SmolLM2's
    # (<|im_end|>, in every prompt): the last id of the vocabulary, a rare word piece, instead.
    pad_id = cfg.vocab_size - 1
    if (prompts == pad_id).any():
      raise ValueError(f"pad id {pad_id} occurs in a prompt: tunix would mask it as padding")
    _use_config_rope_theta(cfg.rope_theta)
    self.model = llama_params.create_model_from_safe_tensors(path, cfg, dtype=jnp.float32)
    self.prompt_len, self.new = prompts.shape[1], new
    cache = CacheConfig(cache_size=self.prompt_len + new, num_layers=cfg.num_layers,
                        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    self.sampler = Sampler(self.model, PreparedIds(prompts, pad_id), cache)
    self.keys = [f"row{i}" for i in range(prompts.shape[0])]

  def _call(self, temperature: float, seed: int, top_p: float):
    sampling = {} if temperature == 0 else dict(temperature=temperature, top_p=top_p)
    return self.sampler(self.keys, max_generation_steps=self.new, max_prompt_length=self.prompt_len,
                        eos_tokens=[NEVER], seed=seed, pad_output=True, **sampling)

  def generate(self, prompts: np.ndarray, temperature: float, seed: int, top_p: float = 1.0):
    """Returns (tokens [B, new], seconds); `prompts` must be the rows given at construction."""
    del prompts
    out, t = timed(self._call, temperature, seed, top_p)
    tokens = np.stack([np.asarray(t_)[: self.new] for t_ in out.tokens])
    assert tokens.shape[1] == self.new, tokens.shape
    return tokens, t
