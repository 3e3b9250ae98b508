"""Draft-and-verify decode: a small draft model proposes `k` tokens per row, the target scores them
in one cached forward pass, and each row keeps its longest valid prefix (`draft_rule.verify`), so
the tokens follow the target's own sampling distribution (and equal its greedy decode at temperature
0) while the target reads its weights once per up to k + 1 tokens.

Shapes: B rows, k draft tokens per verify pass, N max new tokens, V vocabulary (the target's; a
draft of the same tokenizer may have fewer embedding rows: it proposes none past them), W attended
window.

Both models keep a KV cache of the same tokens (prefill and append go to both: `prefill`, `append`,
`copy_rows` here). Inside the one jitted `lax.while_loop` each row's last emitted token is
`pending`: sampled but not yet in either cache. A verify pass runs [pending, x_0 .. x_{k-1}] through
the target at each row's own length (k + 1 logits: p_0 .. p_k); the draft's steps before it ran
[backlog, x_0 .. x_{k-2}] (the backlog is pending, after x_{k-1} when the last pass kept all k).
Rows keep different counts, so their cache lengths advance unevenly; a row's length is simply set
to cover only what it kept, since a cached pass never reads a slot at or past a row's length (the
`CacheView.filled` mask) and the next pass overwrites it. Stop ids, stop rules and budgets are
applied token by token to the kept run, and the tokens after a stop are dropped, so a row ends
exactly where a plain decode would. After the loop one closing pass writes each row's pending token
(and the draft's backlog): the caches then hold every generated token and `logits` follow the last,
as `Sampler.decode` leaves them, so the next turn simply appends.

Programs: one per (target window, draft window); k, the windows and N are static, the sampling
settings, keys, budgets and stop tables traced. Each pass holds the draft's [B, k, V] and the
target's [B, k + 1, V] fp32 log-probs (Qwen2.5's 152k vocabulary, B = 32, k = 4: 78 and 97 MB).
Metrics: `draft_acceptance` = kept / proposed draft tokens, `tokens_per_verify` = generated tokens /
target passes per row (a plain decode's is 1.0; the closing pass counts).

The co-located simulator uses it (`env.model_backend`, config.simulator.draft_checkpoint): prefill
/ append / copy_rows / with_lengths (rewinds, a lent row's reset) go through this class, so both
caches hold the same tokens. Decode segments run as `Sampler.decode`'s do (`decode`: one call per
`decode_segment` tokens, each a fresh key stream, each with a closing pass). A draft on its own
mesh runs inside the target's program;
each cache comes back in the layout it came in. The target's `CallCounts` records each call's
verify passes and draft steps.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlver_jax.models.qwen2 import Qwen2
from rlver_jax.parallel.sharding import host_array
from rlver_jax.sampling.draft_rule import _NEG, draw, row_keys, token_logprobs, verify
from rlver_jax.sampling.kv_cache import KVCache
from rlver_jax.sampling.sampler import DecodeResult, Sampler, _Collected, bucket, rows_going_on
from rlver_jax.sampling.stop_rules import StopRules, StopState, StopTables
from rlver_jax.sampling.strategies import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
  """The carry of the draft-and-verify loop (all traced)."""
  round: jax.Array          # [] int32 verify passes so far
  cache: KVCache            # the target's; excludes `pending`
  logits: jax.Array         # [B, V] fp32 after a finished row's last cached token
  draft_cache: KVCache      # excludes `backlog`
  backlog: jax.Array        # [B, 2] int32 tokens the draft still has to read
  backlog_n: jax.Array      # [B] int32 how many (0..2)
  pending: jax.Array        # [B] int32 the last emitted token
  has_pending: jax.Array    # [B] bool: it is not in the target's cache yet
  count: jax.Array          # [B] int32 tokens generated per row
  done: jax.Array           # [B] bool
  stopped: jax.Array        # [B] bool: ended on a stop id
  tokens: jax.Array         # [B, N] int32
  sample_logp: jax.Array    # [B, N] fp32 under the target's sampling distribution
  model_logp: jax.Array     # [B, N] fp32 under the raw target
  proposed: jax.Array       # [B] int32 draft tokens proposed
  accepted: jax.Array       # [B] int32 of them kept by the rule
  passes: jax.Array         # [B] int32 target passes (verify passes and the closing write)
  rules: StopState | None = None


def _emit(s: SpecState, z_BxC, n_cand_B, slp_BxC, mlp_BxC, stop_ids, budget_B, tables):
  """Takes each live row's candidates z[:, :n_cand] in order until a stop or its budget. Returns
  (state with tokens, counts and stop flags updated, [B] tokens emitted)."""
  B, C = z_BxC.shape
  N = s.tokens.shape[1]
  rows = jnp.arange(B)
  alive, ended = ~s.done, jnp.zeros((B,), bool)
  count, stopped, rules = s.count, s.stopped, s.rules
  tokens, slp, mlp = s.tokens, s.sample_logp, s.model_logp
  emitted = jnp.zeros((B,), jnp.int32)
  for i in range(C):
    emit = alive & (i < n_cand_B)
    tok = z_BxC[:, i]
    at = jnp.where(emit, count, N)  # out of range: dropped
    tokens = tokens.at[rows, at].set(tok, mode="drop")
    slp = slp.at[rows, at].set(slp_BxC[:, i], mode="drop")
    mlp = mlp.at[rows, at].set(mlp_BxC[:, i], mode="drop")
    is_stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1) & emit
    rule_stop = False
    if rules is not None:
      rules, rule_stop = rules.advance(tables, tok, emit)
    count = count + emit
    emitted = emitted + emit
    stopped = stopped | is_stop
    end_here = emit & (is_stop | rule_stop | (count >= budget_B))
    ended, alive = ended | end_here, alive & ~end_here
  s = dataclasses.replace(s, count=count, done=s.done | ended, stopped=stopped, tokens=tokens,
                          sample_logp=slp, model_logp=mlp, rules=rules)
  return s, emitted


def last_logits(model: Qwen2, cache: KVCache, tokens_BxT, num_B, window):
  """Runs T tokens per row at the row's length; (logits after each row's num-th token [B, V],
  the cache written, lengths advanced by num)."""
  T = tokens_BxT.shape[1]
  positions = cache.lengths[:, None] + jnp.arange(T)[None, :]
  # A draft with fewer embedding rows reads the target's ids past them as its last row.
  tokens_BxT = jnp.minimum(tokens_BxT, model.config.vocab_size - 1)
  hidden, written = model.cached_hidden_states(tokens_BxT, positions, cache.view(window))
  last = jnp.take_along_axis(hidden, jnp.maximum(num_B - 1, 0)[:, None, None], axis=1)[:, 0]
  return model.logits(last).astype(jnp.float32), written.advanced(num_B)


def verify_pass(target: Qwen2, cache: KVCache, fed_BxK1, qs_BxKxV, key, sampling: SamplingParams,
                window: int):
  """The verify pass: [pending, x_0 .. x_{k-1}] (`fed`) at each row's length gives p_0 .. p_k,
  and the acceptance rule (`draft_rule.verify`) each row's kept count n and next token y.
  Returns (the cache written, not advanced; logits [B, k+1, V] fp32; p; n; y)."""
  B, K1 = fed_BxK1.shape
  positions = cache.lengths[:, None] + jnp.arange(K1)[None, :]
  hidden, written = target.cached_hidden_states(fed_BxK1, positions, cache.view(window))
  logits = target.logits(hidden).astype(jnp.float32)
  V = logits.shape[-1]
  p = token_logprobs(logits.reshape(B * K1, V), sampling).reshape(B, K1, V)
  n, y = verify(p, qs_BxKxV, fed_BxK1[:, 1:], key)
  return written, logits, p, n, y


def _widened(logits_BxVd, V: int):
  """A draft's logits over the target's V ids: those past its rows (an embedding padded to another
  size, as Qwen2.5's small and large models are) get none of its probability."""
  extra = V - logits_BxVd.shape[-1]
  return jnp.pad(logits_BxVd, ((0, 0), (0, extra)), constant_values=_NEG) if extra else logits_BxVd


def _spec_decode_fn(t_graphdef, t_params, cache: KVCache, logits_BxV, d_graphdef, d_params,
                    draft_cache: KVCache, active_B, budget_B, stop_ids, rng,
                    sampling: SamplingParams, tables: StopTables | None = None,
                    rule_state: StopState | None = None, *, k, window, draft_window, max_new,
                    pad_id) -> SpecState:
  """Up to max_new tokens per live row; a later segment of one decode passes the stop rules'
  progress so far (`rule_state`)."""
  target: Qwen2 = nnx.merge(t_graphdef, t_params)
  drafter: Qwen2 = nnx.merge(d_graphdef, d_params)
  B = logits_BxV.shape[0]
  zeros_i = jnp.zeros((B,), jnp.int32)
  live = active_B & (budget_B > 0)
  zeros_f = jnp.zeros((B, max_new), jnp.float32)
  s = SpecState(round=jnp.int32(0), cache=cache, logits=logits_BxV.astype(jnp.float32),
                draft_cache=draft_cache, backlog=jnp.full((B, 2), pad_id, jnp.int32),
                backlog_n=zeros_i, pending=jnp.full((B,), pad_id, jnp.int32),
                has_pending=live, count=zeros_i, done=~live, stopped=jnp.zeros((B,), bool),
                tokens=jnp.full((B, max_new), pad_id, jnp.int32), sample_logp=zeros_f,
                model_logp=zeros_f, proposed=zeros_i, accepted=zeros_i, passes=zeros_i,
                rules=rule_state if tables is None or rule_state is not None else tables.start())
  # The first token comes from the logits the caller holds, as in a plain decode.
  p0 = token_logprobs(s.logits, sampling)
  tok = jnp.where(live, draw(row_keys(rng, 0), p0), pad_id)
  pick = lambda a, t: jnp.take_along_axis(a, t[..., None], axis=-1)[..., 0]
  s, _ = _emit(s, tok[:, None], live.astype(jnp.int32), pick(p0, tok)[:, None],
               pick(jax.nn.log_softmax(s.logits, axis=-1), tok)[:, None], stop_ids, budget_B, tables)
  s = dataclasses.replace(s, pending=tok, backlog=s.backlog.at[:, 0].set(tok),
                          backlog_n=live.astype(jnp.int32))

  def cond(s: SpecState):
    return (s.round < max_new) & ~jnp.all(s.done)

  def body(s: SpecState) -> SpecState:
    go = ~s.done
    key_draft, key_verify = (jax.random.split(row_keys(rng, s.round + 1)) if not rng.ndim else
                             jax.vmap(jax.random.split, out_axes=1)(row_keys(rng, s.round + 1)))

    def draft_step(i, carry):  # reads the backlog (step 0) or the last proposal, proposes x_i
      dcache, inp, n_in, xs, qs = carry
      q_logits, dcache = last_logits(drafter, dcache, inp, jnp.where(go, n_in, 0), draft_window)
      q = token_logprobs(_widened(q_logits, V), sampling)
      x = jnp.where(go, draw(row_keys(key_draft, i), q), pad_id)
      inp = jnp.stack([x, jnp.full_like(x, pad_id)], axis=1)
      return dcache, inp, jnp.ones_like(n_in), xs.at[:, i].set(x), qs.at[:, i].set(q)

    V = s.logits.shape[-1]
    dcache, _, _, xs, qs = jax.lax.fori_loop(
        0, k, draft_step, (s.draft_cache, s.backlog, s.backlog_n, jnp.zeros((B, k), jnp.int32),
                           jnp.zeros((B, k, V), jnp.float32)))
    fed = jnp.concatenate([s.pending[:, None], xs], axis=1)
    written, logits_all, p, n, y = verify_pass(target, s.cache, fed, qs, key_verify, sampling,
                                               window)
    col = jnp.arange(k + 1)[None, :]
    z = jnp.where(col < n[:, None], jnp.pad(xs, ((0, 0), (0, 1))), y[:, None])  # x_0..x_{n-1}, y
    raw_logp = pick(logits_all, z) - jax.nn.logsumexp(logits_all, axis=-1)  # no [B, k+1, V] copy
    s2, emitted = _emit(s, z, n + 1, pick(p, z), raw_logp, stop_ids, budget_B, tables)
    kept = jnp.minimum(emitted, n)               # proposals emitted (now cached after pending)
    y_out = go & (emitted == n + 1)              # y emitted: the next pending token
    all_x = kept == k
    # Rows that ended inside the proposals have everything cached: their logits follow x_{kept-1}.
    closed = go & ~y_out
    logits = jnp.where(closed[:, None],
                       jnp.take_along_axis(logits_all, kept[:, None, None], axis=1)[:, 0], s.logits)
    d_len = s.draft_cache.lengths + s.backlog_n + jnp.minimum(kept, k - 1)
    backlog = jnp.stack([jnp.where(all_x, xs[:, -1], y), y], axis=1)
    return dataclasses.replace(
        s2, round=s.round + 1,
        cache=dataclasses.replace(written, lengths=jnp.where(go, s.cache.lengths + 1 + kept,
                                                             s.cache.lengths)),
        logits=logits,
        draft_cache=dataclasses.replace(dcache, lengths=jnp.where(go, d_len, s.draft_cache.lengths)),
        backlog=jnp.where(go[:, None], backlog, s.backlog),
        backlog_n=jnp.where(go, all_x.astype(jnp.int32) + y_out, s.backlog_n),
        pending=jnp.where(y_out, y, s.pending), has_pending=jnp.where(go, y_out, s.has_pending),
        proposed=s.proposed + k * go, accepted=s.accepted + jnp.where(go, n, 0),
        passes=s.passes + go)

  s = jax.lax.while_loop(cond, body, s)
  # Closing pass: the pending token into the target's cache, the backlog into the draft's.
  logits, cache = last_logits(target, s.cache, s.pending[:, None],
                              s.has_pending.astype(jnp.int32), window)
  _, draft_cache = last_logits(drafter, s.draft_cache, s.backlog, s.backlog_n, draft_window)
  return dataclasses.replace(s, cache=cache, draft_cache=draft_cache,
                             logits=jnp.where(s.has_pending[:, None], logits, s.logits),
                             passes=s.passes + s.has_pending)


_SEGMENT_KEYS = 1 << 30  # a later segment's key: folded past any verify pass's own index


def _placed(tree, layout):
  """`tree` with each leaf not in its `layout` sharding moved there."""
  return jax.tree.map(lambda a, sh: a if a.sharding == sh else jax.device_put(a, sh), tree, layout)


@dataclasses.dataclass(frozen=True)
class SpeculativeResult:
  """`decode` as `Sampler.decode` returns it (the target's tokens, cache and logits), the draft's
  cache holding the same tokens, and per-row counts for the metrics."""
  decode: DecodeResult
  draft_cache: KVCache
  proposed: np.ndarray  # [B] draft tokens proposed
  accepted: np.ndarray  # [B] of them kept
  passes: np.ndarray    # [B] target forward passes (verify passes + the closing write)

  def metrics(self) -> dict[str, float]:
    counts = DraftCounts()
    counts.add(self)
    return counts.take()


class DraftCounts:
  """Draft tokens proposed and kept, target passes and generated tokens, summed over decodes until
  `take` turns them into `draft_acceptance` (kept / proposed) and `tokens_per_verify` (tokens /
  passes, per row) and starts again."""

  def __init__(self):
    self._n = np.zeros(4, np.float64)

  def add(self, r: SpeculativeResult) -> None:
    self._n += [r.proposed.sum(), r.accepted.sum(), r.passes.sum(), r.decode.num_tokens.sum()]

  def take(self) -> dict[str, float]:
    proposed, accepted, passes, tokens = self._n
    self._n = np.zeros(4, np.float64)
    return {"draft_acceptance": accepted / max(proposed, 1.0),
            "tokens_per_verify": tokens / max(passes, 1.0)}


class SpeculativeSampler:
  """Decodes with `target` (a `Sampler`) and `draft` (a `Sampler` over the same vocabulary), `k`
  draft tokens per verify pass. The target's stop ids, pad id and windows apply."""

  def __init__(self, target: Sampler, draft: Sampler, k: int):
    if k < 1:
      raise ValueError(f"draft tokens per verify pass must be >= 1, got {k}")
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if dv > tv:  # fewer rows is fine: a tokenizer's ids padded to another embedding size
      raise ValueError(f"the draft's vocabulary ({dv} tokens) differs from the target's ({tv})")
    self.target, self.draft, self.k = target, draft, k
    self._decode = jax.jit(_spec_decode_fn, donate_argnums=(2, 6),
                           static_argnames=("t_graphdef", "d_graphdef", "k", "window",
                                            "draft_window", "max_new", "pad_id"))

  def init_caches(self, batch: int) -> tuple[KVCache, KVCache]:
    return self.target.init_cache(batch), self.draft.init_cache(batch)

  def padded_rows(self, rows: int) -> int:
    """Cache rows that both models' meshes shard fully (the draft's may split rows differently)."""
    rows = self.target.padded_rows(rows)
    while self.draft.padded_rows(rows) != rows:
      rows = self.target.padded_rows(self.draft.padded_rows(rows))
    return rows

  def prefill(self, params, draft_params, caches, rows: Sequence[Sequence[int]]):
    """Both caches emptied and filled with `rows`. Returns ((cache, draft_cache), target logits)."""
    cache, logits = self.target.prefill(params, caches[0], rows)
    draft_cache, _ = self.draft.prefill(draft_params, caches[1], self._for_draft(rows))
    return (cache, draft_cache), logits

  def append(self, params, draft_params, caches, rows: Sequence[Sequence[int]], prev_logits=None):
    """`Sampler.append` on both caches. Returns ((cache, draft_cache), target logits)."""
    cache, logits = self.target.append(params, caches[0], rows, prev_logits)
    draft_cache, _ = self.draft.append(draft_params, caches[1], self._for_draft(rows))
    return (cache, draft_cache), logits

  def _for_draft(self, rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """`rows` with ids past the draft's embedding (the target's padding rows) set to its last id:
    the draft only proposes, so an approximate context costs acceptance, never exactness."""
    top = self.draft.config.vocab_size - 1
    return [[min(int(t), top) for t in r] for r in rows]

  def copy_rows(self, caches, logits, sources: dict[int, int]):
    """`Sampler.copy_rows` on both caches (the draft's logits are not kept, so zeros stand in)."""
    cache, logits = self.target.copy_rows(caches[0], logits, sources)
    draft_cache, _ = self.draft.copy_rows(caches[1], self.draft.empty_logits(caches[1].batch_size),
                                          sources)
    return (cache, draft_cache), logits

  @staticmethod
  def with_lengths(caches, lengths):
    """Both caches rewound (or reset) to `lengths` [B], as `KVCache.with_lengths` does to one."""
    return tuple(c.with_lengths(lengths) for c in caches)

  def decode(self, params, draft_params, caches, logits, *, rng: jax.Array, max_new_tokens: int,
             sampling: SamplingParams | None = None, active: Sequence[bool] | None = None,
             budget: Sequence[int] | None = None, reserve: int = 0,
             stop_rules: StopRules | None = None) -> SpeculativeResult:
    """As `Sampler.decode` (same arguments and stopping), with the draft proposing."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
        or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    cache, draft_cache = caches
    t, d = self.target, self.draft
    B = cache.batch_size
    lengths = host_array(cache.lengths)
    if draft_cache.batch_size != B or not np.array_equal(lengths, host_array(draft_cache.lengths)):
      raise ValueError(f"the draft's cache lengths {host_array(draft_cache.lengths).tolist()} differ "
                       f"from the target's {lengths.tolist()}: both must hold the same tokens")
    if reserve < 0:
      raise ValueError(f"reserve must be >= 0, got {reserve}")
    sampling = sampling or SamplingParams.make()
    active = np.ones(B, bool) if active is None else np.asarray(active, bool)
    budget = np.full(B, max_new_tokens) if budget is None else np.minimum(budget, max_new_tokens)
    room = np.maximum(min(t.max_len, d.max_len) - reserve - lengths, 0)
    budget = np.where(active, np.minimum(budget, room), 0).astype(np.int32)
    if stop_rules is not None:
      stop_rules.check(B, t.config.vocab_size)
    tables = None if stop_rules is None else stop_rules.device()
    # As `Sampler.decode`: calls of `decode_segment` tokens (the rules' progress as host arrays,
    # so every segment of a window runs one program), each a fresh key stream.
    rule_state = None if tables is None else jax.tree.map(np.asarray, tables.start())
    seg = min(t.decode_segment or max_new_tokens, max_new_tokens)
    out = _Collected.empty(B, max_new_tokens, t.pad_id)
    counts = np.zeros((3, B), np.int64)  # proposed, accepted, target passes
    live = active & (budget > 0)
    rng, first = t._here(rng), 0
    layouts = [jax.tree.map(lambda a: a.sharding, c) for c in (cache, draft_cache)]
    while True:
      # Each row's budget still unspent, at most a segment (a call writes at most max_new tokens).
      left = np.minimum(np.where(live, budget - out.count, 0), seg)
      reach = int(max((lengths + out.count + left).max(), 1))
      window = bucket(reach, t.decode_windows)
      # A draft step reads up to k - 1 proposals past what a row has emitted.
      draft_window = bucket(min(reach + self.k, d.max_len), d.decode_windows)
      with t._on_mesh():
        s: SpecState = self._decode(
            t.graphdef, params, cache, logits, d.graphdef, draft_params, draft_cache,
            jnp.asarray(live), jnp.asarray(left), t.stop_ids,
            rng if first == 0 else row_keys(rng, _SEGMENT_KEYS + first), sampling, tables,
            None if rule_state is None else jax.tree.map(jnp.asarray, rule_state),
            k=self.k, window=window, draft_window=draft_window, max_new=seg, pad_id=t.pad_id)
      # Each cache goes back in the layout it came in (a draft on its own mesh comes out in the
      # target's; lengths may come out split another way), so no later call compiles again.
      cache, draft_cache = (_placed(c, l) for c, l in zip((s.cache, s.draft_cache), layouts))
      logits = s.logits
      part = DecodeResult(tokens=host_array(s.tokens), num_tokens=host_array(s.count),
                          sample_logp=host_array(s.sample_logp),
                          model_logp=host_array(s.model_logp), stopped=host_array(s.stopped),
                          cache=cache, logits=logits,
                          rule_stopped=None if s.rules is None else host_array(s.rules.hit))
      out.add(part)
      passes = host_array(s.passes)
      counts += np.stack([host_array(s.proposed), host_array(s.accepted), passes])
      t.calls.verify(window, draft_window, int(passes.max(initial=0)), self.k)
      first += seg
      live, rule_state = rows_going_on(live, part, out.count, budget, s.rules, rule_state)
      if not live.any() or first >= max_new_tokens:
        return SpeculativeResult(decode=out.result(cache, logits), draft_cache=draft_cache,
                                 proposed=counts[0], accepted=counts[1], passes=counts[2])
