r"""Chat with or generate from a checkpoint on the KV-cached sampler.

  python -m rlver_jax.generate --chat --prompt="How do I calm down before an exam?"
  python -m rlver_jax.generate --checkpoint=DIR --prompt=TEXT --temperature=0 --output_json=out.json
  python -m rlver_jax.generate --chat --interactive --checkpoint=Qwen/Qwen2.5-0.5B-Instruct

The default checkpoint is the embedded SmolLM2-135M-Instruct; a Hub id (`ORG/NAME[@REV]`) is read
from the Hugging Face cache, downloaded if need be. `--temperature=0` is greedy.
"""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from rlver_jax import build
from rlver_jax.cli.errors import exit_on
from rlver_jax.models.io import hub, storage
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.run.workdir import refuse_training_workdir
from rlver_jax.cli.flags import parse_flags
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams
from rlver_jax.spec.sections import PolicySpec

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "HF safetensors directory or Hub id ORG/NAME[@REV] "
                                  "(default: embedded model).")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (the first user turn with --chat).")
_SYSTEM = flags.DEFINE_string("system", None, "System prompt with --chat (default: the template's own).")
_CHAT = flags.DEFINE_bool("chat", False, "Render the prompt with the checkpoint's chat template.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Most tokens generated per reply.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.7, "Sampling temperature; 0 means greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus mass (1 = off).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k (0 = off).")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_BATCH = flags.DEFINE_integer("batch_size", 1, "Independent samples of the same prompt.")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Write prompt/generated ids, text and log-probs.")
_INTERACTIVE = flags.DEFINE_bool("interactive", False, "Terminal chat; the KV cache persists across turns.")
_MAX_LEN = flags.DEFINE_integer("max_len", 2048, "KV cache slots per row (prompt + all turns).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Param and compute dtype.")


def _prompt_ids(chat: ChatTokens, text: str, system: str | None, use_chat: bool) -> list[int]:
  if not use_chat:
    return chat.encode(text)
  messages = ([{"role": "system", "content": system}] if system is not None else [])
  messages.append({"role": "user", "content": text})
  return chat.conversation(messages, add_generation_prompt=True)


def _room(sampler: Sampler, cache) -> int:
  """Tokens the row may still sample, keeping one slot to close a reply cut short with <|im_end|>."""
  return max(sampler.max_len - int(cache.lengths[0]) - 1, 0)


def _interactive(sampler: Sampler, params, chat: ChatTokens, system: str | None, sp, rng):
  cache = sampler.init_cache(1)
  first = True
  logits = None
  while True:
    try:
      text = input("you> ")
    except EOFError:
      return
    if text.strip() in ("/exit", "/quit"):
      return
    if first:
      ids = _prompt_ids(chat, text, system, use_chat=True)
    else:
      ids = chat.encode("\n") + chat.message("user", text) + chat.generation_header()
    if len(ids) + 1 > _room(sampler, cache):  # the turn plus at least one reply token must fit
      print(f"[context full: {sampler.max_len} slots (--max_len); the conversation ends here]", flush=True)
      return
    if first:
      cache, logits = sampler.prefill(params, cache, [ids])
      first = False
    else:
      cache, logits = sampler.append(params, cache, [ids])
    rng, key = jax.random.split(rng)
    res = sampler.decode(params, cache, logits, rng=key, max_new_tokens=_MAX_NEW.value, sampling=sp,
                         reserve=1)
    cache = res.cache
    reply = res.row(0)
    print("bot>", chat.decode(reply, skip_special_tokens=True).strip(), flush=True)
    if reply[-1:] != [chat.im_end]:  # cut by the budget or ended by <|endoftext|>: close the turn
      cache, logits = sampler.append(params, cache, [[chat.im_end]])


def check_checkpoint(path: str) -> str:
  """The local or gs:// Hugging Face checkpoint directory of --checkpoint (a Hub id's cached snapshot),
  checked before anything loads."""
  if hub.is_hub_id(path):
    path = hub.resolve(path, "--checkpoint")
  if not storage.is_gcs(path) and not os.path.isdir(path):
    raise FileNotFoundError(f"--checkpoint={path}: no such directory")
  refuse_training_workdir(path, "--checkpoint")
  if not storage.exists(storage.join(path, "config.json")):
    raise FileNotFoundError(f"--checkpoint={path}: no config.json there (not a Hugging Face checkpoint)")
  return path


def _check_output_json(path: str) -> None:
  """Fails before the model loads if the JSON file cannot be written where asked."""
  parent = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise ValueError(f"--output_json={path}: is a directory")
  if not os.path.isdir(parent):
    raise FileNotFoundError(f"--output_json={path}: directory {parent} does not exist")
  if not os.access(parent, os.W_OK):
    raise ValueError(f"--output_json={path}: directory {parent} is not writable")


def _check_flags() -> tuple[SamplingParams, str | None]:
  """Validates the flags before the model loads; returns the sampling settings and the checkpoint
  directory (None: the embedded model)."""
  if _INTERACTIVE.value:
    # The terminal supplies every turn and prints every reply, one conversation (batch 1).
    for name in ("prompt", "output_json", "batch_size"):
      if flags.FLAGS[name].present:
        raise ValueError(f"--{name} cannot be used with --interactive")
  elif _PROMPT.value is None:
    raise ValueError("--prompt is required (or use --interactive)")
  elif _CHAT.value and not _PROMPT.value.strip():  # the template alone is no user turn
    raise ValueError("--prompt is empty: --chat needs a user turn to answer")
  if _SYSTEM.value is not None and not (_CHAT.value or _INTERACTIVE.value):
    raise ValueError("--system needs --chat (or --interactive): a plain prompt has no system turn")
  for name, flag, low in (("max_new_tokens", _MAX_NEW, 1), ("batch_size", _BATCH, 1), ("max_len", _MAX_LEN, 2)):
    if flag.value < low:
      raise ValueError(f"--{name}={flag.value}: must be >= {low}")
  if _OUTPUT_JSON.value:
    _check_output_json(_OUTPUT_JSON.value)
  sampling = SamplingParams.make(_TEMPERATURE.value, _TOP_P.value, _TOP_K.value)
  # Last: a Hub id may download.
  checkpoint = check_checkpoint(_CHECKPOINT.value) if _CHECKPOINT.value is not None else None
  return sampling, checkpoint


def _check_prompt(ids: list[int]) -> None:
  if not ids:
    raise ValueError("--prompt encodes to no tokens: there is nothing to continue")
  if len(ids) >= _MAX_LEN.value:
    raise ValueError(f"the prompt is {len(ids)} tokens and --max_len={_MAX_LEN.value} leaves no room for "
                     f"a reply (needs at least {len(ids) + 1})")


def main(argv):
  del argv
  try:
    _generate()
  except (ValueError, FileNotFoundError) as e:  # bad input: one line, non-zero exit
    exit_on(e)


def _generate():
  sp, checkpoint = _check_flags()
  if checkpoint is None:
    from rlver_jax.models.embedded import embedded_model_dir
    checkpoint = embedded_model_dir()
  chat = ChatTokens(load_tokenizer(checkpoint))
  ids = None
  if not _INTERACTIVE.value:
    ids = _prompt_ids(chat, _PROMPT.value, _SYSTEM.value, _CHAT.value)
    _check_prompt(ids)  # before the model loads
  # The run's own assembly (build): the model and its sampler as an evaluation would load them.
  # One decode call per reply (no segments), as generate always ran: a seed keeps its samples.
  policy = PolicySpec(checkpoint=checkpoint, param_dtype=_DTYPE.value, compute_dtype=_DTYPE.value,
                      max_context=_MAX_LEN.value, decode_segment=0, window_step=0)
  model, _, _ = build.load_policy(policy, mesh=None)
  build.check_context(model.config.max_position_embeddings, _MAX_LEN.value, "--max_len")
  sampler = build.policy_sampler(model, chat, policy, mesh=None)
  params = nnx.state(model)
  rng = jax.random.key(_SEED.value)
  if _INTERACTIVE.value:
    _interactive(sampler, params, chat, _SYSTEM.value, sp, rng)
    return
  batch = _BATCH.value
  cache, logits = sampler.prefill(params, sampler.init_cache(batch), [ids] * batch)
  res = sampler.decode(params, cache, logits, rng=rng, max_new_tokens=_MAX_NEW.value, sampling=sp)
  rows = [res.row(b) for b in range(batch)]
  texts = [chat.decode(r, skip_special_tokens=True) for r in rows]
  for b, text in enumerate(texts):
    prefix = f"[{b}] " if batch > 1 else ""
    print(prefix + text.strip())
  if _OUTPUT_JSON.value:
    out = {"prompt_token_ids": [ids] * batch, "token_ids": rows, "text": texts,
           "logprobs": [res.model_logp[b, : len(r)].tolist() for b, r in enumerate(rows)]}
    with open(_OUTPUT_JSON.value, "w") as f:
      json.dump(out, f, ensure_ascii=False)
  sys.stdout.flush()


if __name__ == "__main__":
  jax.config.update("jax_platforms", jax.config.jax_platforms or "")
  app.run(main, flags_parser=parse_flags)
