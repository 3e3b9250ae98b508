"""On-device KV-cached sampling for multi-turn dialogues: prefill, append and a while-loop decode.

Shapes: B rows, T appended tokens (bucketed), N max new tokens, V vocabulary, W attended cache window.

The multi-turn primitive is `append`: new tokens (a user turn, an instruction) go right after each
row's own cache length; nothing already cached is recomputed. `prefill` is an append onto an emptied
cache. `decode` runs one jitted `lax.while_loop` until every row has hit a stop id or its budget; the
generated tokens, stop token included, are in the cache afterwards, so the next turn just appends.
Optional `stop_rules.StopRules` end rows early on token sequences or at the end of a labelled line,
checked inside the loop with traced tables.

Static shapes keep compiles bounded: appended lengths are padded to `append_buckets`, and attention
reads only a window of the cache bucketed to a power of two >= the longest row, so cost follows the
filled length rather than the preallocated maximum. Sampling settings are traced (never recompile).

A long decode may run in segments of `decode_segment` tokens, each call attending a window that
covers only what its rows can reach by its end, from `decode_windows` (powers of two, then steps of
`window_step`): a 512-token simulator turn late in a 16k dialogue then reads ~1.05x its filled cache,
not the next power of two above its length plus its whole budget (~1.3x). The segments continue one
stream: the step keys, stop-rule progress and per-row budgets carry over, so the tokens equal one
call's (up to the float summation order of a wider window's masked slots).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rlver_jax.models.qwen2 import Qwen2
from rlver_jax.sampling.call_counts import CallCounts
from rlver_jax.sampling.kv_cache import KVCache, Layout, default_layout
from rlver_jax.sampling.stop_rules import StopRules, StopState, StopTables
from rlver_jax.sampling.strategies import SamplingParams, sample
from rlver_jax.parallel.sharding import DEFAULT_RULES, global_array, host_array, padded_batch


DEFAULT_APPEND_BUCKETS = (16, 64, 256, 1024)


def bucket(n: int, buckets: Sequence[int]) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"length {n} exceeds the largest bucket {buckets[-1]}")


def window_buckets(max_len: int, min_window: int = 64, step: int = 0) -> tuple[int, ...]:
  """Attention windows: powers of two from min_window, then (step > 0) multiples of `step` once the
  power of two reaches it, capped by max_len."""
  out, w = [], min_window
  while w < max_len:
    out.append(w)
    w = (w // step + 1) * step if step and 2 * w > step else 2 * w
  return tuple(out) + (max_len,)


@dataclasses.dataclass(frozen=True)
class DecodeResult:
  """What `Sampler.decode` returns: the generated tokens on the host, the cache and logits on device."""
  tokens: np.ndarray        # [B, N] int32; pad_id after a row's last token
  num_tokens: np.ndarray    # [B] generated tokens per row (stop token included)
  sample_logp: np.ndarray   # [B, N] log-prob under the sampling distribution (0 for greedy)
  model_logp: np.ndarray    # [B, N] log-prob under the raw model (T=1, no truncation)
  stopped: np.ndarray       # [B] True where the row ended on a stop id (False: budget/cache full)
  cache: KVCache
  logits: jax.Array         # [B, V] fp32 after each row's last cached token: decode may go on from here
  rule_stopped: np.ndarray | None = None  # [B] True where a stop rule ended the row (None: no rules)

  def row(self, b: int) -> list[int]:
    return self.tokens[b, : self.num_tokens[b]].tolist()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """The carry of the decode `lax.while_loop` (every field traced, so no step recompiles)."""
  step: jax.Array           # [] int32 tokens sampled so far (the column written next)
  cache: KVCache
  logits: jax.Array         # [B, V] fp32 after each row's last cached token
  count: jax.Array          # [B] int32 tokens generated per row
  done: jax.Array           # [B] bool: the row samples no more
  stopped: jax.Array        # [B] bool: the row ended on a stop id
  tokens: jax.Array         # [B, N] int32, pad_id where nothing was sampled
  sample_logp: jax.Array    # [B, N] fp32 under the sampling distribution
  model_logp: jax.Array     # [B, N] fp32 under the raw model
  rules: StopState | None = None  # progress through the stop rules (None: the call has none)

  @staticmethod
  def start(cache: KVCache, logits_BxV, active_B, budget_B, *, max_new: int, pad_id: int,
            rules: StopTables | None = None) -> "DecodeState":
    B = logits_BxV.shape[0]
    zeros_f = jnp.zeros((B, max_new), jnp.float32)
    return DecodeState(step=jnp.int32(0), cache=cache, logits=logits_BxV.astype(jnp.float32),
                       count=jnp.zeros((B,), jnp.int32), done=~active_B | (budget_B <= 0),
                       stopped=jnp.zeros((B,), bool), tokens=jnp.full((B, max_new), pad_id, jnp.int32),
                       sample_logp=zeros_f, model_logp=zeros_f,
                       rules=None if rules is None else rules.start())

  def result(self) -> DecodeResult:
    """The host copy of the generated tokens (one transfer per array), device cache and logits."""
    return DecodeResult(tokens=host_array(self.tokens), num_tokens=host_array(self.count),
                        sample_logp=host_array(self.sample_logp), model_logp=host_array(self.model_logp),
                        stopped=host_array(self.stopped), cache=self.cache, logits=self.logits,
                        rule_stopped=None if self.rules is None else host_array(self.rules.hit))


@dataclasses.dataclass
class _Collected:
  """A decode's host results gathered over its segments (each row's tokens after its earlier ones)."""
  tokens: np.ndarray
  sample_logp: np.ndarray
  model_logp: np.ndarray
  count: np.ndarray
  stopped: np.ndarray
  rule_stopped: np.ndarray | None = None

  @staticmethod
  def empty(B: int, N: int, pad_id: int) -> "_Collected":
    return _Collected(np.full((B, N), pad_id, np.int32), np.zeros((B, N), np.float32),
                      np.zeros((B, N), np.float32), np.zeros(B, np.int32), np.zeros(B, bool))

  def add(self, part: DecodeResult) -> None:
    N = self.tokens.shape[1]
    for b in np.nonzero(part.num_tokens)[0]:
      at, n = self.count[b], min(part.num_tokens[b], N - self.count[b])
      for mine, theirs in ((self.tokens, part.tokens), (self.sample_logp, part.sample_logp),
                           (self.model_logp, part.model_logp)):
        mine[b, at:at + n] = theirs[b, :n]
    self.count = self.count + part.num_tokens
    self.stopped = self.stopped | part.stopped
    if part.rule_stopped is not None:
      self.rule_stopped = part.rule_stopped if self.rule_stopped is None \
          else self.rule_stopped | part.rule_stopped

  def result(self, cache: KVCache, logits) -> DecodeResult:
    return DecodeResult(tokens=self.tokens, num_tokens=self.count, sample_logp=self.sample_logp,
                        model_logp=self.model_logp, stopped=self.stopped, cache=cache,
                        logits=logits, rule_stopped=self.rule_stopped)


def _append_fn(graphdef, params, cache: KVCache, tokens_BxT, num_new_B, prev_logits_BxV, *, window):
  model: Qwen2 = nnx.merge(graphdef, params)
  T = tokens_BxT.shape[1]
  positions = cache.lengths[:, None] + jnp.arange(T)[None, :]
  hidden, written = model.cached_hidden_states(tokens_BxT, positions, cache.view(window))
  last = jnp.take_along_axis(hidden, jnp.maximum(num_new_B - 1, 0)[:, None, None], axis=1)[:, 0]
  logits = model.logits(last)
  logits = jnp.where((num_new_B > 0)[:, None], logits, prev_logits_BxV)
  return written.advanced(num_new_B), logits


def _copy_rows_fn(cache: KVCache, logits_BxV, source_B):
  """Row b takes row source_B[b]'s slots, length and last logits."""
  return cache.take_rows(source_B), logits_BxV[source_B]


def _step_key(rng: jax.Array, step: jax.Array) -> jax.Array:
  """The key of one decode step: from the call's key, or from each row's own ([B] keys)."""
  if rng.ndim:
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(rng, step)
  return jax.random.fold_in(rng, step)


def _decode_fn(graphdef, params, cache: KVCache, logits_BxV, active_B, budget_B, stop_ids, rng,
               sampling: SamplingParams, rules: StopTables | None = None,
               rule_state: StopState | None = None, first_step=0, *, window, max_new,
               pad_id) -> DecodeState:
  """Up to max_new tokens per active row. A later segment of one decode passes the rules' progress
  so far (`rule_state`) and how many steps came before (`first_step`: its step keys go on from there)."""
  model: Qwen2 = nnx.merge(graphdef, params)

  def cond(s: DecodeState):
    return (s.step < max_new) & ~jnp.all(s.done)

  def body(s: DecodeState) -> DecodeState:
    tok, slp, mlp = sample(s.logits, _step_key(rng, first_step + s.step), sampling)
    live = ~s.done
    tok = jnp.where(live, tok, pad_id)
    col = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x[:, None].astype(buf.dtype),
                                                            s.step, axis=1)
    lengths = s.cache.lengths
    hidden, written = model.cached_hidden_states(tok[:, None], lengths[:, None], s.cache.view(window))
    count = s.count + live
    is_stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1) & live
    progress, rule_stop = (None, False) if s.rules is None else s.rules.advance(rules, tok, live)
    return DecodeState(
        step=s.step + 1, cache=written.advanced(live),
        logits=jnp.where(live[:, None], model.logits(hidden[:, 0]), s.logits),
        count=count, done=s.done | is_stop | rule_stop | (count >= budget_B),
        stopped=s.stopped | is_stop, tokens=col(s.tokens, tok),
        sample_logp=col(s.sample_logp, jnp.where(live, slp, 0.0)),
        model_logp=col(s.model_logp, jnp.where(live, mlp, 0.0)), rules=progress)

  start = DecodeState.start(cache, logits_BxV, active_B, budget_B, max_new=max_new, pad_id=pad_id,
                            rules=rules)
  if rule_state is not None:
    start = dataclasses.replace(start, rules=rule_state)
  # A finished row keeps its logits, so each row ends with those after its last cached token.
  return jax.lax.while_loop(cond, body, start)


def _check_ids(rows: Sequence[Sequence[int]], vocab: int) -> None:
  """Host-side check: an id outside [0, vocab) would embed as NaN (or wrap, if negative) on device."""
  for b, row in enumerate(rows):
    if len(row) == 0:
      continue
    ids = np.asarray(row)
    if not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"row {b}: token ids must be integers, got dtype {ids.dtype}")
    bad = np.nonzero((ids < 0) | (ids >= vocab))[0]
    if bad.size:
      i = int(bad[0])
      raise ValueError(f"row {b}, position {i}: token id {int(ids[i])} is outside the vocabulary "
                       f"[0, {vocab})")


def rows_going_on(live: np.ndarray, part: "DecodeResult", count: np.ndarray, budget: np.ndarray,
                  rules, rule_state):
  """After a decode segment: the rows that go on where it cut them short (neither stopped, by a
  stop id or a stop rule, nor out of budget), and the stop rules' progress as host arrays (so every
  segment of a window runs one program); `rule_state` as it was without stop rules."""
  live = live & ~part.stopped & (count < budget)
  if part.rule_stopped is not None:
    live = live & ~part.rule_stopped
    rule_state = jax.tree.map(host_array, rules)
  return live, rule_state


class Sampler:
  """Runs a Qwen2 model's prefill / append / decode programs on a KV cache of `max_len` slots.

  Params are passed to every call (the live training params; nothing is copied), so the same
  sampler serves a policy whose weights change between rollouts.
  """

  def __init__(self, model: Qwen2, *, max_len: int, stop_ids: Sequence[int], pad_id: int = 0,
               append_buckets: Sequence[int] = DEFAULT_APPEND_BUCKETS, min_window: int = 64,
               mesh: jax.sharding.Mesh | None = None, cache_dtype=None,
               cache_layout: Layout | None = None, decode_segment: int = 0, window_step: int = 0):
    if max_len < 1 or min_window < 1:
      raise ValueError(f"max_len ({max_len}) and min_window ({min_window}) must be >= 1")
    if decode_segment < 0 or window_step < 0:
      raise ValueError(f"decode_segment ({decode_segment}) and window_step ({window_step}) must be "
                       ">= 0 (0 = one call per decode, power-of-two windows)")
    self.graphdef = nnx.graphdef(model)
    self.config = model.config
    self.max_len = max_len
    self.stop_ids = jnp.asarray(list(stop_ids), jnp.int32)
    vocab = model.config.vocab_size
    if not 0 <= pad_id < vocab:
      # An id outside the embedding table reads NaN (jnp.take's fill) and poisons every padded row.
      raise ValueError(f"pad_id {pad_id} is not a token id of this model (vocabulary [0, {vocab}))")
    self.pad_id = pad_id
    # No append can outgrow the cache, so buckets past max_len collapse into max_len.
    self.append_buckets = tuple(sorted({min(b, max_len) for b in append_buckets}))
    self.windows = window_buckets(max_len, min_window)  # appends: few programs per chunk size
    self.decode_windows = window_buckets(max_len, min_window, window_step)
    self.decode_segment = decode_segment
    self.mesh = mesh
    self.cache_dtype = cache_dtype or model.dtype
    self.cache_layout = cache_layout or default_layout()  # pass "slots_major" when compiling for TPU
    self._zeros = {}
    self._append = jax.jit(_append_fn, static_argnames=("graphdef", "window"), donate_argnums=(2,))
    self._decode = jax.jit(_decode_fn, static_argnames=("graphdef", "window", "max_new", "pad_id"),
                           donate_argnums=(2,))
    self._copy_rows = {}  # by the inputs' shardings: the copy keeps them (no resharding later)
    self.calls = CallCounts()  # program calls, read by the trainer's step metrics

  def _on_mesh(self):
    """The sampler's mesh as the ambient one while its programs trace and run, whatever the caller
    set (a model may decode in its own layout under the trainer's mesh): the model's activation
    constraints and the sampling filters' per-shard top-k read it."""
    if self.mesh is None:
      return contextlib.nullcontext()
    return jax.set_mesh(self.mesh)

  def _here(self, x):
    """A small input (a key) committed to another mesh, replicated onto this sampler's: the other
    mesh may order the same devices differently, which a jitted program refuses."""
    sharding = getattr(x, "sharding", None)
    if self.mesh is None or not isinstance(sharding, NamedSharding) or sharding.mesh == self.mesh:
      return x
    target = NamedSharding(self.mesh, PartitionSpec())
    if not sharding.is_fully_replicated:
      return jax.device_put(x, target)
    # Every process holds the whole value: placed from there, as multi-host device_put between
    # meshes does not take every pair of shardings.
    is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    value = global_array(np.asarray((jax.random.key_data(x) if is_key else x).addressable_data(0)),
                         target)
    return jax.random.wrap_key_data(value, impl=jax.random.key_impl(x)) if is_key else value

  def padded_rows(self, rows: int) -> int:
    """Cache rows for `rows` dialogues on this sampler's mesh (`sharding.padded_batch`)."""
    return padded_batch(rows, self.mesh)

  def init_cache(self, batch: int) -> KVCache:
    return KVCache.allocate(self.config, batch, self.max_len, self.cache_dtype, self.mesh,
                            layout=self.cache_layout)

  def empty_logits(self, batch: int) -> jax.Array:
    if batch not in self._zeros:
      shape = (batch, self.config.vocab_size)
      if self.mesh is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      else:
        sharding = DEFAULT_RULES.sharding(self.mesh, ("batch", "act_vocab"), shape)
      self._zeros[batch] = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)
    return self._zeros[batch]()

  def prefill(self, params, cache: KVCache, rows: Sequence[Sequence[int]]):
    """Empties the cache and fills each row with its own tokens. Returns (cache, last logits [B, V])."""
    self.calls.prefill()
    return self.append(params, cache.with_lengths(np.zeros(cache.batch_size, np.int32)), rows,
                       _kind="prefill")

  def append(self, params, cache: KVCache, rows: Sequence[Sequence[int]], prev_logits=None,
             _kind: str = "append"):
    """Appends rows[b] after row b's cached tokens (an empty list leaves the row untouched).

    Returns (cache, logits [B, V] at each row's last token; rows without new tokens keep prev_logits).
    Inputs longer than the largest bucket go in several chunks.
    """
    B = cache.batch_size
    if len(rows) != B:
      raise ValueError(f"append got {len(rows)} rows for a cache of batch {B}")
    lengths = host_array(cache.lengths)
    new = np.array([len(r) for r in rows])
    over = np.nonzero(lengths + new > self.max_len)[0]
    if over.size:
      b = int(over[0])
      raise ValueError(f"row {b}: {lengths[b]} cached + {new[b]} new tokens exceed the cache length "
                       f"{self.max_len}")
    _check_ids(rows, self.config.vocab_size)
    logits = self.empty_logits(B) if prev_logits is None else prev_logits
    chunk = self.append_buckets[-1]
    for start in range(0, max(int(new.max()), 1), chunk):
      part = [list(r[start:start + chunk]) for r in rows]
      n = np.array([len(p) for p in part], np.int32)
      T = bucket(max(int(n.max()), 1), self.append_buckets)
      tokens = np.full((B, T), self.pad_id, np.int32)
      for b, p in enumerate(part):
        tokens[b, : len(p)] = p
      # The window covers what was cached before this chunk; the new tokens are their own segment.
      window = bucket(max(int(lengths.max()), 1), self.windows)
      self.calls.append_chunk(_kind, T, window)
      with self._on_mesh():
        cache, logits = self._append(self.graphdef, params, cache, jnp.asarray(tokens), jnp.asarray(n),
                                     logits, window=window)
      lengths = lengths + n
    return cache, logits

  def copy_rows(self, cache: KVCache, logits, sources: dict[int, int]):
    """Returns (cache, logits) in which each row `dst` of `sources` is a copy of row `sources[dst]`
    (its cached keys/values, length and last logits); other rows are unchanged. Rows sharing a
    prefix then compute it once: prefill one row, copy it to the others."""
    B = cache.batch_size
    index = np.arange(B, dtype=np.int32)
    for dst, src in sources.items():
      if not (0 <= dst < B and 0 <= src < B):
        raise ValueError(f"copy_rows: row {src} -> {dst} is outside the cache's {B} rows")
      if src in sources and sources[src] != src:
        raise ValueError(f"copy_rows: row {src} is both copied from and overwritten")
      index[dst] = src
    if (index == np.arange(B)).all():
      return cache, logits
    shardings = (jax.tree.map(lambda a: a.sharding, cache), logits.sharding)
    key = tuple(jax.tree.leaves(shardings))
    if key not in self._copy_rows:
      self._copy_rows[key] = jax.jit(_copy_rows_fn, donate_argnums=(0,), out_shardings=shardings)
    with self._on_mesh():
      return self._copy_rows[key](cache, logits, jnp.asarray(index))

  def decode(self, params, cache: KVCache, logits, *, rng: jax.Array, max_new_tokens: int,
             sampling: SamplingParams | None = None, active: Sequence[bool] | None = None,
             budget: Sequence[int] | None = None, reserve: int = 0,
             stop_rules: StopRules | None = None) -> DecodeResult:
    """Samples up to max_new_tokens per active row, stopping each row at a stop id or its budget.

    `rng` is one key for the call, or [B] keys, one per row: each row's tokens then follow from its
    own key alone (the rollout's per-dialogue streams), whatever the other rows are.

    `reserve` slots stay free after every row's reply (e.g. 1 to close a reply cut short with
    <|im_end|>); the cache's end bounds the budget either way. `stop_rules` (`stop_rules.StopRules`)
    also end rows on token sequences or at the end of a labelled line, checked on device; the
    result equals a decode without them truncated after each row's stopping token.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
        or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    B = cache.batch_size
    sampling = sampling or SamplingParams.make()
    lengths = host_array(cache.lengths)
    if reserve < 0:
      raise ValueError(f"reserve must be >= 0, got {reserve}")
    for name, given in (("active", active), ("budget", budget)):
      if given is not None and np.shape(given) != (B,):
        raise ValueError(f"{name} has shape {np.shape(given)}; the cache has {B} rows, so it needs ({B},)")
    active = np.ones(B, bool) if active is None else np.asarray(active, bool)
    budget = np.full(B, max_new_tokens) if budget is None else np.minimum(budget, max_new_tokens)
    room = np.maximum(self.max_len - reserve - lengths, 0)  # never write past the cache
    budget = np.minimum(budget, room).astype(np.int32)
    if stop_rules is not None:
      stop_rules.check(B, self.config.vocab_size)
    tables = None if stop_rules is None else stop_rules.device()
    # The rules' progress goes in from the first segment on, and as host arrays each time, so that
    # every segment of a window calls the same compiled program (a tiny [B, width] state).
    rule_state = None if tables is None else jax.tree.map(np.asarray, tables.start())
    seg = min(self.decode_segment or max_new_tokens, max_new_tokens)
    out = _Collected.empty(B, max_new_tokens, self.pad_id)
    live = active & (budget > 0)
    rng = self._here(rng)
    first = 0
    while True:
      left = np.where(live, budget - out.count, 0)  # each row's budget still unspent
      # The window covers every slot a live row can reach by the end of this segment.
      window = bucket(int(max((lengths + out.count + np.minimum(left, seg)).max(), 1)),
                      self.decode_windows)
      with self._on_mesh():
        final: DecodeState = self._decode(
            self.graphdef, params, cache, logits, jnp.asarray(live), jnp.asarray(left),
            self.stop_ids, rng, sampling, tables,
            None if rule_state is None else jax.tree.map(jnp.asarray, rule_state),
            np.int32(first), window=window, max_new=seg, pad_id=self.pad_id)
      part = final.result()
      self.calls.decode(window, int(part.num_tokens.max(initial=0)))
      cache, logits = part.cache, part.logits
      out.add(part)
      first += seg
      live, rule_state = rows_going_on(live, part, out.count, budget, final.rules, rule_state)
      if not live.any() or first >= max_new_tokens:
        return out.result(cache, logits)
