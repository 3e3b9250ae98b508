"""Token selection from logits with traced settings: greedy, temperature, top-k, top-p.

Shapes: B rows, V vocabulary. Every setting is a traced scalar, so changing it never recompiles:
temperature 0 means greedy, top_k 0 means off, top_p 1 means off. All math is fp32 (log-probs are
trained on; bf16 would bias them).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from rlver_jax.parallel.sharding import DEFAULT_RULES

_NEG = -1e30


def sampling_needs(temperature: float, top_p: float, top_k: int) -> dict[str, str]:
  """The settings out of range, each with what it must be (empty: all usable). The one statement of
  these ranges: `SamplingParams.make` and the run spec (which names the config key) both use it."""
  integer_k = isinstance(top_k, (int, np.integer)) and not isinstance(top_k, bool)
  needs = {}
  if not 0 <= temperature < float("inf"):  # a plain comparison with NaN is False: refused too
    needs["temperature"] = ">= 0 (0 = greedy)"
  if not 0 < top_p <= 1:
    needs["top_p"] = "in (0, 1]"
  if not integer_k or top_k < 0:
    needs["top_k"] = "an integer >= 0 (0 = off)"
  return needs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array

  @staticmethod
  def make(temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> "SamplingParams":
    if sampling_needs(temperature, top_p, top_k):
      raise ValueError(f"bad sampling settings: temperature={temperature} (>= 0), top_p={top_p} "
                       f"(in (0, 1]), top_k={top_k!r} (an integer >= 0)")
    # Any k at or past the vocabulary keeps everything; int32 is the traced type.
    return SamplingParams(jnp.float32(temperature), jnp.float32(top_p),
                          jnp.int32(min(int(top_k), 2**31 - 1)))


def _order_keys(x: jax.Array) -> jax.Array:
  """uint32 keys whose unsigned order is the float order of x (fp32)."""
  u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(1 << 31))


def _smallest_key_where(keys: jax.Array, holds) -> jax.Array:
  """Per row, the smallest uint32 key t with holds(t) [B] true, for a predicate monotone in t (false
  below some point, true from it on): 32 steps of bisection, each one pass over the row."""
  B = keys.shape[0]
  lo = jnp.zeros((B,), jnp.uint32)                 # holds(t) may be false at lo
  hi = jnp.full((B,), 0xFFFFFFFF, jnp.uint32)      # holds(hi) is assumed true

  def step(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = holds(mid)
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

  lo, hi = jax.lax.fori_loop(0, 32, step, (lo, hi))
  return hi


# Exact top values taken per row before any bisection: every top-k up to this many, and every nucleus
# of fewer tokens, is cut from these alone. The embedded model at T=0.7, top_p=0.9: nuclei of median
# 2, p99 34 tokens; 0.1% of 1,024 sampled row-steps held more (benchmarks/sampling_step.py).
_CANDIDATES = 64


def _vocab_split(B: int, V: int):
  """(the mesh in context, the [B, V] logits' PartitionSpec on it, how many ways it splits V), or
  (None, None, 1) outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  named = {a for name in ("batch", "act_vocab") for a in DEFAULT_RULES.mesh_axes(name)}
  if mesh is None or mesh.empty or not named <= set(mesh.axis_names):
    return None, None, 1  # not one of our meshes: leave the placement to XLA
  spec = DEFAULT_RULES.spec(("batch", "act_vocab"), (B, V), mesh)
  axes = () if spec[1] is None else (spec[1],) if isinstance(spec[1], str) else spec[1]
  return mesh, spec, math.prod(mesh.shape[a] for a in axes)


def _top_values(logits_BxV: jax.Array, n: int) -> jax.Array:
  """The n largest values of each row, descending. On a mesh each device takes the top n of its own
  block of the logits and, over a split vocabulary, the top n of the B x shards x n values gathered
  along the row: XLA's partitioner would gather the whole [B, V] onto every device for a `top_k`."""
  B, V = logits_BxV.shape
  mesh, spec, shards = _vocab_split(B, V)
  top = lambda x: jax.lax.top_k(x, n)[0]
  if mesh is None:
    return top(logits_BxV)
  local = jax.shard_map(top, mesh=mesh, in_specs=spec, out_specs=spec)(logits_BxV)
  if shards == 1:
    return local
  rows = P(spec[0], None)
  return jax.shard_map(top, mesh=mesh, in_specs=rows, out_specs=rows)(local)


def _smallest_kept(logits: jax.Array, keys: jax.Array, cut_key: jax.Array) -> jax.Array:
  """The smallest logit among tokens whose key is >= cut_key: the bisection's cut as a logit."""
  return jnp.min(jnp.where(keys >= cut_key[:, None], logits, jnp.inf), axis=-1)


def _cut_top_k(state, top_k: jax.Array, n: int):
  """(logits, candidates) with everything below each row's k-th largest logit masked: the cut from
  the candidates when k <= n, else by bisection (the smallest key t with count(keys > t) < k is the
  k-th largest's key)."""
  logits, top = state
  k = jnp.clip(top_k, 1, logits.shape[-1])

  def by_bisection(_):
    keys = _order_keys(logits)
    kth = _smallest_key_where(keys, lambda t: jnp.sum(keys > t[:, None], axis=-1) < k)
    return _smallest_kept(logits, keys, kth)

  cut = jax.lax.cond(k <= n, lambda _: jax.lax.dynamic_index_in_dim(top, k - 1, 1, False),
                     by_bisection, None)
  return jnp.where(logits >= cut[:, None], logits, _NEG), jnp.where(top >= cut[:, None], top, _NEG)


def _cut_top_p(state, top_p: jax.Array) -> jax.Array:
  """The logits with everything outside each row's top-p nucleus masked."""
  logits, top = state
  mass = jnp.exp(top - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
  # Mass of the candidates ahead of each one (an exclusive sum: no subtraction to round).
  before = jnp.cumsum(jnp.pad(mass[:, :-1], ((0, 0), (1, 0))), axis=-1)
  # The cut is the last candidate with mass ahead < top_p, if a later candidate has mass ahead >= it.
  inside = jnp.all(before[:, -1] >= top_p)

  def from_candidates(_):
    last = jnp.sum(before < top_p, axis=-1) - 1
    return jnp.take_along_axis(top, last[:, None], axis=-1)[:, 0]

  def by_bisection(_):  # keep p_i when mass(p > p_i) < top_p; that mass only shrinks as t grows
    probs = jax.nn.softmax(logits, axis=-1)
    keys = _order_keys(probs)
    cut = _smallest_key_where(
        keys, lambda t: jnp.sum(jnp.where(keys > t[:, None], probs, 0.0), axis=-1) < top_p)
    return _smallest_kept(logits, keys, cut)

  cut = jax.lax.cond(inside, from_candidates, by_bisection, None)
  return jnp.where(logits >= cut[:, None], logits, _NEG)


def filter_logits(logits_BxV: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Masks tokens outside the top-k and outside the top-p nucleus (logits already temperature-scaled).

  The nucleus is the smallest set of most likely tokens whose mass reaches top_p; a token is kept
  when the mass of the tokens strictly more likely than it is < top_p, so the most likely token is
  always kept, and ties with a kept token are kept. Each filter becomes a per-row cut logit (keep
  logits >= cut). The cut is read off each row's 64 largest values (`lax.top_k`) when it lies among
  them for every row of the batch, as it does for every top_k <= 64 and every nucleus of < 64
  tokens; otherwise the whole batch finds it by bisection on the values' bit patterns (32 passes over
  each row, each a cross-device reduction over a split vocabulary). The two agree up to fp32 rounding
  of the mass ahead of a token (~1e-7). No full sort: XLA:CPU sorts a 49k vocabulary at ~10 ms per
  row. A top_p 0.9 sampling step at 8 x 49k on the 2-core CPU: 9.8 ms by bisection, 2.3 from candidates.
  On a mesh, call this under `jax.set_mesh` (the Sampler does): the candidates are then taken per
  vocabulary shard; without it XLA gathers the whole [B, V] for the `top_k`.
  """
  V = logits_BxV.shape[-1]
  n = min(_CANDIDATES, V // _vocab_split(*logits_BxV.shape)[2])
  logits = logits_BxV.astype(jnp.float32)

  def filtered(logits):
    # Candidates only where a cut may come from them; a top_k above n alone bisects without them.
    wanted = ((top_k > 0) & (top_k <= n)) | (top_p < 1.0)
    top = jax.lax.cond(wanted, lambda x: _top_values(x, n),
                       lambda x: jnp.full(x.shape[:1] + (n,), _NEG, x.dtype), logits)
    state = (logits, top)
    state = jax.lax.cond(top_k > 0, lambda s: _cut_top_k(s, top_k, n), lambda s: s, state)
    return jax.lax.cond(top_p < 1.0, lambda s: _cut_top_p(s, top_p), lambda s: s[0], state)

  logits = jax.lax.cond((top_k > 0) | (top_p < 1.0), filtered, lambda x: x, logits)
  return logits.astype(logits_BxV.dtype)


def _pick(x_BxV: jax.Array, tokens_B: jax.Array) -> jax.Array:
  return jnp.take_along_axis(x_BxV, tokens_B[:, None], axis=-1)[:, 0]


def _grid_rows(V: int) -> int:
  """R of the [R, V // R] view `categorical` draws in: a divisor of V near sqrt(V), a multiple of 128
  where V has one, so a vocabulary split over the tensor axis stays split in the view (R is its
  major dimension; 152k-token Qwen2.5: 128 x 1187, 49k SmolLM2: 256 x 192)."""
  divisors = {d for i in range(1, math.isqrt(V) + 1) if V % i == 0 for d in (i, V // i)}
  pool = [d for d in divisors if d % 128 == 0] or sorted(divisors)
  return min(pool, key=lambda d: (abs(math.log(d) - math.log(V) / 2), d))


def categorical(key: jax.Array, logits_BxV: jax.Array) -> jax.Array:
  """One token per row drawn from softmax(logits); `key` is one key for the batch or one per row
  ([B] keys: a row's draw then depends on its own key alone, not on its position or the batch)."""
  if key.ndim:
    return jax.vmap(lambda k, row: _categorical(k, row[None])[0])(key, logits_BxV)
  return _categorical(key, logits_BxV)


def _categorical(key: jax.Array, logits_BxV: jax.Array) -> jax.Array:
  """One token per row drawn from softmax(logits), exactly, from ~2 sqrt(V) random numbers per row.

  Token t sits at (t // C, t % C) of an [R, C] view. First a column c is drawn by the columns' total
  masses, then a row r from column c's own logits: P(c) P(r | c) = p(t). `jax.random.categorical`
  over the whole row needs V Gumbel draws (two logs each): 5.2 ms alone at batch 8 x 49k on the
  2-core CPU, against 0.3 ms this way. Masked tokens (-1e30) have zero mass.
  """
  B, V = logits_BxV.shape
  R = _grid_rows(V)
  grid = logits_BxV.reshape(B, R, V // R)
  top = jnp.max(logits_BxV, axis=-1)[:, None, None]
  column_mass = jnp.sum(jnp.exp(grid - top), axis=1)                          # [B, C]
  key_c, key_r = jax.random.split(key)
  c = jax.random.categorical(key_c, jnp.log(column_mass), axis=-1)
  in_column = jnp.take_along_axis(grid, c[:, None, None], axis=2)[:, :, 0]   # [B, R]
  r = jax.random.categorical(key_r, in_column, axis=-1)
  return (r * (V // R) + c).astype(jnp.int32)


def _argmax(x_BxV: jax.Array, top_Bx1: jax.Array) -> jax.Array:
  """`jnp.argmax` (first maximum; first NaN if any) given the row maxima: two vectorised passes,
  where XLA:CPU's (value, index) reduction took 1.9 ms at 8 x 152k against 1.1 ms this way."""
  index = jax.lax.broadcasted_iota(jnp.int32, x_BxV.shape, 1)
  return jnp.min(jnp.where((x_BxV == top_Bx1) | jnp.isnan(x_BxV), index, x_BxV.shape[1]), axis=1)


def sample(logits_BxV: jax.Array, key: jax.Array, params: SamplingParams):
  """Returns (tokens [B], log-prob under the sampling distribution [B], raw model log-prob [B]).

  Greedy (temperature 0) takes the argmax with sampling log-prob 0 and skips the filters and the
  random draw at run time (a `lax.cond` on the traced temperature): the argmax is always inside the
  top-k and the nucleus, so the result is the same.
  """
  logits = logits_BxV.astype(jnp.float32)
  top = jnp.max(logits, axis=-1, keepdims=True)  # shared by the argmax and the raw log-probs

  def greedy(_):
    return _argmax(logits, top), jnp.zeros(logits.shape[:1], jnp.float32)

  def sampled(_):
    # Shifted to <= 0 first: a tiny temperature must not overflow to inf (then inf - inf = NaN).
    scaled = filter_logits((logits - top) / params.temperature, params.top_k, params.top_p)
    tokens = categorical(key, scaled)
    return tokens, _pick(scaled, tokens) - jax.nn.logsumexp(scaled, axis=-1)

  tokens, sample_logp = jax.lax.cond(params.temperature <= 0, greedy, sampled, None)
  log_z = top[:, 0] + jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
  return tokens, sample_logp, _pick(logits, tokens) - log_z
