"""lm-evaluation-harness model backed by this package's Qwen2 model and KV-cached sampler.

Shapes: B rows (the batch, padded to `batch_size`), T tokens per row (bucketed), Q scored requests
(B x a power of two; requests share rows), C scored tokens per request (bucketed), D hidden size,
V vocabulary.

Text in, text out, as lm-eval's `TemplateLM` asks; tokenisation follows lm-eval's own Hugging Face
backend (`HFLM`) rule for rule (special tokens, the BOS/EOS prefix of an empty context, rolling
windows, left truncation, stop strings), so scores differ from it only by float rounding.

- `loglikelihood` / `loglikelihood_rolling`: one full causal forward per batch of right-padded rows;
  only the hidden states of the scored positions go through the LM head (a multiple-choice
  continuation is a few tokens, the vocabulary 50-150k), log-softmax in fp32.
- `generate_until`: prefill + `lax.while_loop` decode on the sampler, in rounds of `decode_chunk`
  tokens; between rounds the host cuts rows whose text reached a stop string.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs,
                                  postprocess_generated_text)

from rlver_jax.models.io import storage
from rlver_jax.sampling.sampler import Sampler, bucket, window_buckets
from rlver_jax.sampling.strategies import SamplingParams
from rlver_jax.parallel.sharding import (DEFAULT_RULES, batch_shards, global_array, host_array,
                                         round_up)

_SCORE_BLOCK = 256  # scored positions per LM-head block: bounds the [Q, C, V] logits
_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k"}


def _score_fn(graphdef, params, tokens_BxT, row_Q, start_Q, targets_QxC, valid_QxC):
  """Per request q: sum of log p(target) over its valid scored positions, and whether each was the
  argmax. Requests share rows (Q >= B): request q reads row row_Q[q], its scored position j is the
  logit at index start_Q[q] + j (it predicts targets_QxC[q, j])."""
  model = nnx.merge(graphdef, params)
  hidden_BxTxD = model.hidden_states(tokens_BxT)
  T, C = tokens_BxT.shape[1], targets_QxC.shape[1]
  idx_QxC = jnp.clip(start_Q[:, None] + jnp.arange(C)[None, :], 0, T - 1)
  h_QxCxD = hidden_BxTxD[row_Q[:, None], idx_QxC]
  block = min(C, _SCORE_BLOCK)

  def score(args):  # one block of positions: [Q, c, D], [Q, c] -> [Q, c] log-probs, greedy flags
    h, tgt = args
    logp = jax.nn.log_softmax(model.logits(h), axis=-1)  # fp32: sums of many small log-probs
    picked = jnp.take_along_axis(logp, tgt[:, :, None], axis=-1)[..., 0]
    return picked, jnp.argmax(logp, axis=-1) == tgt

  blocks = lambda x: jnp.moveaxis(x.reshape(x.shape[0], C // block, block, *x.shape[2:]), 1, 0)
  picked, greedy = jax.lax.map(score, (blocks(h_QxCxD), blocks(targets_QxC)))
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], C)
  picked, greedy = unblock(picked), unblock(greedy)
  return (jnp.sum(jnp.where(valid_QxC, picked, 0.0), axis=1),
          jnp.all(greedy | ~valid_QxC, axis=1))


def stop_token_ids(tokenizer, checkpoint_dir: str | None) -> tuple[int, ...]:
  """The ids Hugging Face `generate` stops on: generation_config.json's, else config.json's
  eos_token_id (an int or a list), plus the tokenizer's EOS."""
  out: list[int] = []
  for name in ("generation_config.json", "config.json") if checkpoint_dir else ():
    path = storage.join(checkpoint_dir, name)
    if storage.exists(path):
      eos = json.loads(storage.read_bytes(path)).get("eos_token_id")
      if eos is not None:
        out += eos if isinstance(eos, list) else [eos]
        break
  if tokenizer.eos_token_id is not None:
    out.append(tokenizer.eos_token_id)
  return tuple(dict.fromkeys(int(i) for i in out))


class RlverLM(TemplateLM):
  """lm-eval `LM` over a loaded `Qwen2` and its Hugging Face tokenizer (see the module docstring).

  Every host of a multi-host run executes the same requests (one SPMD program; lm-eval's own
  rank / world size stay 0 / 1), and every host gets the same results."""

  def __init__(self, model, tokenizer, *, batch_size: int = 8, max_length: int = 2048,
               max_gen_toks: int = 256, mesh: jax.sharding.Mesh | None = None, seed: int = 1234,
               decode_chunk: int = 64, add_bos_token: bool | None = None,
               checkpoint_dir: str | None = None, name: str = "rlver_jax"):
    super().__init__()
    if batch_size < 1 or max_length < 2 or max_gen_toks < 1 or decode_chunk < 1:
      raise ValueError(f"batch_size ({batch_size}), max_gen_toks ({max_gen_toks}) and decode_chunk "
                       f"({decode_chunk}) must be >= 1, max_length ({max_length}) >= 2")
    self.model, self.tokenizer, self.mesh = model, tokenizer, mesh
    self.graphdef, self.params = nnx.split(model)
    self._batch = round_up(batch_size, 1 if mesh is None else batch_shards(mesh))
    self._max_length, self._max_gen_toks = max_length, max_gen_toks
    self.decode_chunk, self.add_bos_token = decode_chunk, add_bos_token
    self.checkpoint_dir, self.name = checkpoint_dir, name
    self._rng = jax.random.key(seed)
    self._lengths = window_buckets(max_length, 16)
    self._score = jax.jit(_score_fn, static_argnames=("graphdef",))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    self.pad_id = int(pad or 0)
    self.sampler = Sampler(model, max_len=max_length, stop_ids=stop_token_ids(tokenizer, checkpoint_dir),
                           pad_id=self.pad_id, mesh=mesh)
    self._cache = None

  # -- what lm-eval reads ------------------------------------------------------------------------

  @property
  def eot_token_id(self) -> int:
    return self.tokenizer.eos_token_id

  @property
  def prefix_token_id(self) -> int:
    bos = self.tokenizer.bos_token_id
    return bos if bos is not None else self.tokenizer.eos_token_id

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def batch_size(self) -> int:
    return self._batch

  @property
  def tokenizer_name(self) -> str:
    return str(self.tokenizer.name_or_path).replace("/", "__")

  def get_model_info(self) -> dict:
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))
    return {"model_num_parameters": n, "model_dtype": str(self.model.dtype),
            "model_checkpoint": self.checkpoint_dir or ""}

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    kw = {}
    if add_special_tokens is not None:
      kw["add_special_tokens"] = add_special_tokens
    elif self.add_bos_token is not None:
      kw["add_special_tokens"] = self.add_bos_token
    if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
      kw["add_special_tokens"] = False  # the (chat-templated) text already starts with BOS
    return list(self.tokenizer.encode(string, **kw))

  def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
    return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    return self.tokenizer.apply_chat_template(
        chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=not add_generation_prompt)

  # -- scoring -----------------------------------------------------------------------------------

  def _put(self, x: np.ndarray) -> jax.Array:
    if self.mesh is None:
      return jnp.asarray(x)
    axes = ("batch",) + (None,) * (x.ndim - 1)
    return global_array(x, DEFAULT_RULES.sharding(self.mesh, axes, x.shape))

  def _on_mesh(self):
    return self.sampler._on_mesh()

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    """requests: (cache key, context ids, continuation ids) -> [(log-prob, is greedy)] in order."""
    # Requests with the same input row (context + continuation but its last token: the choices of a
    # multiple-choice question often differ only there) share one forward pass, as in HFLM.
    rows: dict[tuple[int, ...], list[int]] = {}
    for i, (_, ctx, cont) in enumerate(requests):
      if not ctx or not cont:
        raise ValueError("loglikelihood needs a non-empty context and continuation")
      if len(cont) > self.max_length:
        raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length {self.max_length}")
      rows.setdefault(tuple((ctx + cont)[-(self.max_length + 1):][:-1]), []).append(i)
    unique = sorted(rows, key=lambda r: -len(r))
    out: list[tuple[float, bool] | None] = [None] * len(requests)
    B = self.batch_size
    for s in range(0, len(unique), B):
      chunk = unique[s:s + B]
      reqs = [(b, i) for b, r in enumerate(chunk) for i in rows[r]]
      Q = B * _score_len(-(-len(reqs) // B), low=1)  # requests per call: B x a power of two
      T = bucket(len(chunk[0]), self._lengths)
      C = _score_len(max(len(requests[i][2]) for _, i in reqs))
      tokens = np.full((B, T), self.pad_id, np.int32)
      for b, r in enumerate(chunk):
        tokens[b, :len(r)] = r
      row, start = np.zeros((Q,), np.int32), np.zeros((Q,), np.int32)
      targets, valid = np.zeros((Q, C), np.int32), np.zeros((Q, C), bool)
      for q, (b, i) in enumerate(reqs):
        cont = requests[i][2]
        row[q], start[q] = b, len(chunk[b]) - len(cont)
        targets[q, :len(cont)], valid[q, :len(cont)] = cont, True
      with self._on_mesh():
        logp, greedy = self._score(self.graphdef, self.params, self._put(tokens), self._put(row),
                                   self._put(start), self._put(targets), self._put(valid))
      logp, greedy = host_array(logp), host_array(greedy)
      for q, (_, i) in enumerate(reqs):
        out[i] = (float(logp[q]), bool(greedy[q]))
        if requests[i][0] is not None:
          self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owner = [], []
    for r, (string,) in enumerate(req.args for req in requests):
      for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1)):
        windows.append((None, ctx, cont))
        owner.append(r)
    scores = self._loglikelihood_tokens(windows)
    totals = [0.0] * len(requests)
    for r, (logp, _) in zip(owner, scores):
      totals[r] += logp
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  # -- generation --------------------------------------------------------------------------------

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
    out: list[str | None] = [None] * len(requests)
    eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
    for members in groups.values():
      kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
      unknown = sorted(set(kwargs) - _GEN_KWARGS)
      if unknown:  # silently ignoring one (a repetition penalty, beams) would change the scores
        raise ValueError(f"task {requests[members[0]].task_name}: generation setting(s) "
                         f"{', '.join(unknown)} not supported (only {', '.join(sorted(_GEN_KWARGS))})")
      until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
      max_new = int(kwargs.pop("max_gen_toks"))
      if max_new >= self.max_length:
        raise ValueError(f"max_gen_toks {max_new} leaves no room for a prompt in max_length "
                         f"{self.max_length}")
      temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
      sampling = SamplingParams.make(temperature, float(kwargs.get("top_p") or 1.0),
                                     int(kwargs.get("top_k") or 0))
      prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):] for i in members}
      order = sorted(members, key=lambda i: -len(prompts[i]))
      for s in range(0, len(order), self.batch_size):
        idx = order[s:s + self.batch_size]
        for i, text in zip(idx, self._generate([prompts[i] for i in idx], until, max_new, sampling)):
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
    return out

  def _generate(self, prompts: list[list[int]], until: list[str], max_new: int,
                sampling: SamplingParams) -> list[str]:
    """Greedy or sampled continuations of up to `max_new` tokens, cut at the first stop string."""
    n, B = len(prompts), self.batch_size
    if self._cache is None:
      self._cache = self.sampler.init_cache(B)
    rows = prompts + [[self.pad_id]] * (B - n)  # filler rows: one token, never decoded
    cache, logits = self.sampler.prefill(self.params, self._cache, rows)
    tokens: list[list[int]] = [[] for _ in range(B)]
    live = np.arange(B) < n
    chunk = min(self.decode_chunk, max_new)  # one static decode length per group: one compile
    while live.any():
      self._rng, key = jax.random.split(self._rng)
      budget = np.array([max_new - len(t) for t in tokens])
      res = self.sampler.decode(self.params, cache, logits, rng=key, sampling=sampling,
                                max_new_tokens=chunk, active=live, budget=np.where(live, budget, 0))
      cache, logits = res.cache, res.logits
      for b in np.nonzero(live)[0]:
        tokens[b] += res.row(b)
        text = self.tok_decode(tokens[b])
        if res.stopped[b] or len(tokens[b]) >= max_new or any(u and u in text for u in until):
          live[b] = False
    self._cache = cache
    return [postprocess_generated_text(self.tok_decode(t), until, None) for t in tokens[:n]]


def _score_len(n: int, low: int = 8) -> int:
  """Scored positions per request, bucketed: powers of two from `low` (so multiples of the LM-head
  block once past it)."""
  c = low
  while c < n:
    c *= 2
  return c
