"""Token-level RL losses: the policy-gradient losses (PPO clipped surrogate, GSPO, CISPO), clipped
value loss, entropy and KL terms.

Shape legend: B sequences, T tokens, V vocabulary.

`mask` [B, T] is 1 on policy tokens and 0 on prompt, user-simulator and padding tokens. Every
loss is built per token and reduced by `aggregate`, so the reduction is one choice shared by all
terms. Everything is computed in fp32: log-ratios of bf16 log-probs are off by ~1e-2, enough to
flip clipping decisions and to make exp(logp - old_logp) visibly differ from 1 on-policy.

Policy losses (`policy_loss(kind=...)`, A the advantage, r = exp(logp - old_logp) per token):
  ppo: max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)), optionally dual-clipped (A < 0 capped
    at -dual_clip * A). The two bounds are independent, so clip_high > clip_low is exactly DAPO's
    decoupled clip ("clip-higher", 0.2 / 0.28 in DAPO), and agg="token-mean" with weights over the
    whole mini-batch is DAPO's token-level loss: the sum over every policy token of the mini-batch
    (one optimizer update) divided by their count, so long samples weigh by their length.
  gspo: the same surrogate on the sequence ratio s = exp(mean of logp - old_logp over the sequence's
    policy tokens), in GSPO's per-token form (GSPO-token): each token's ratio has the value s and the
    gradient s * grad logp_t. With one advantage per sequence (GRPO) the clip is decided per
    sequence and agg="seq-mean-token-mean" is GSPO's objective exactly (token-mean weighs sequences
    by length); per-token advantages (GAE) are used token by token. One-token sequences: == ppo.
  cispo: -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp (MiniMax-M1's CISPO): the clipped
    ratio is a weight without gradient, so clipped tokens keep a gradient; no dual clip.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rlver_jax.rl import samples
from rlver_jax.rl.rollout_correction import correction_weights

_F32 = jnp.float32
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "chunk-token-mean")
KL_KINDS = ("k1", "k2", "k3")
POLICY_LOSSES = ("ppo", "gspo", "cispo")


def _masked_mean(x: jax.Array, w: jax.Array) -> jax.Array:
  return (x * w).sum() / jnp.maximum(w.sum(), 1.0)


def aggregate(
    loss_tokens: jax.Array,
    mask: jax.Array,
    mode: str = "token-mean",
    *,
    norm_len: int | None = None,
    chunks: int = 1,
    weights: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Reduces a [B, T] per-token loss to a scalar: sum(loss * token_weights(mask, mode, ...)), the
  samples those of `segment_ids` (packed rows) or the rows.

  With `weights` (from `token_weights` over a larger batch), returns sum(loss * weights): summing
  that over micro-batches gives exactly the aggregate of the whole batch.
  """
  x = loss_tokens.astype(_F32)
  if weights is None:
    weights = token_weights(mask, mode, norm_len=norm_len, chunks=chunks, segment_ids=segment_ids)
  return (x * weights).sum()


def token_weights(mask: jax.Array, mode: str = "token-mean", *, norm_len: int | None = None,
                  chunks: int = 1, segment_ids: jax.Array | None = None) -> jax.Array:
  """[B, T] weights with sum(x * weights) the loss of per-token values x under `mode`.

  Modes ("sample": a row, or with `segment_ids` each sample of a packed row, `rl.samples`):
    token-mean: sum over all policy tokens / number of policy tokens (long samples weigh more).
    seq-mean-token-mean: mean over samples of each sample's token mean.
    seq-mean-token-sum-norm: each sample's token sum / a constant (norm_len, default T), then
      the mean over samples (Dr.GRPO: no per-sample length normalisation).
    chunk-token-mean: the samples that hold policy tokens, in order (of their segment id, then of
      their place), cut into `chunks` consecutive runs as even as possible (sizes differ by at most
      one sample); a token mean inside each run, then the mean over the runs. A data-parallel
      trainer whose every device takes a token mean over its share of the rows and averages
      gradients computes this (the RLVER reference: 32 GPUs). One sample a run is
      seq-mean-token-mean; one run is token-mean.
  Samples without policy tokens (batch padding) weigh nothing and count in no mean.
  """
  if mode not in AGG_MODES:
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
  w = (mask > 0).astype(_F32)
  if mode == "token-mean":
    return w / jnp.maximum(w.sum(), 1.0)
  seg = jnp.ones(w.shape, jnp.int32) if segment_ids is None else segment_ids
  run = samples.runs(seg)
  n = run.size
  run_len = jax.ops.segment_sum(w.reshape(-1), run.reshape(-1), num_segments=n)  # exact: 0/1 sums
  has = run_len > 0
  num_seqs = jnp.maximum(has.sum(), 1.0)
  if mode == "seq-mean-token-mean":
    return w / jnp.maximum(run_len[run], 1.0) / num_seqs
  if mode == "seq-mean-token-sum-norm":
    return w / float(mask.shape[-1] if norm_len is None else norm_len) / num_seqs
  if chunks < 1:
    raise ValueError(f"chunk-token-mean needs chunks >= 1, got {chunks}")
  # Rank of each sample among those with policy tokens: by segment id (the packer numbers samples in
  # order), ties (rows of one id each) in place order (a stable sort).
  ids = jax.ops.segment_max(seg.reshape(-1), run.reshape(-1), num_segments=n)
  order = jnp.argsort(jnp.where(has, ids, jnp.iinfo(jnp.int32).max), stable=True)
  rank = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
  chunk = jnp.where(has, (rank * chunks) // jnp.maximum(has.sum(), 1), chunks)
  chunk_tokens = jax.ops.segment_sum(run_len, chunk, num_segments=chunks + 1)[:chunks]
  num_chunks = jnp.maximum((chunk_tokens > 0).sum(), 1.0)
  per_run = jnp.append(chunk_tokens, 1.0)[chunk]
  return w / jnp.maximum(per_run, 1.0)[run] / num_chunks


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    kind: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_len: int | None = None,
    chunks: int = 1,
    rollout_logp: jax.Array | None = None,
    is_correction: str = "none",
    is_cap: float | None = None,
    weights: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The policy-gradient loss `kind` (module docstring), all inputs [B, T]; returns (scalar loss,
  metrics). With `is_correction` (`rl.rollout_correction`; needs `rollout_logp` and `is_cap`) each
  token's loss is scaled by its sampler/trainer importance weight or mask. Sequence-level terms
  (gspo, the seq_* corrections) are per sample of `segment_ids` (`rl.samples`; None: per row).

  Metrics (over policy tokens): clip_frac (the clipped branch is the active one; for cispo, the
  ratio was clipped), dual_clip_frac, approx_kl (k2 = 0.5 * (logp - old_logp)^2 per token),
  ratio_mean/max/min of the ratio the loss used and, with a correction, is_weight_mean.
  """
  if kind not in POLICY_LOSSES:
    raise ValueError(f"unknown policy loss {kind!r}; valid: {', '.join(POLICY_LOSSES)}")
  if dual_clip is not None and (dual_clip <= 1.0 or kind == "cispo"):
    raise ValueError(f"dual_clip must be > 1 and needs a clipped-surrogate loss, got {dual_clip} "
                     f"with {kind}")
  logp = logp.astype(_F32)
  old_logp = jax.lax.stop_gradient(old_logp.astype(_F32))
  adv = jax.lax.stop_gradient(advantages.astype(_F32))
  w = (mask > 0).astype(_F32)

  log_ratio = logp - old_logp
  ratio = jnp.exp(_sequence_log_ratio(log_ratio, logp, w, segment_ids) if kind == "gspo"
                  else log_ratio)
  if kind == "cispo":
    loss_tok, clip_active, dual_active = _cispo_surrogate(adv, ratio, logp, clip_low, clip_high)
  else:
    loss_tok, clip_active, dual_active = _clipped_surrogate(adv, ratio, clip_low, clip_high,
                                                            dual_clip)
  metrics = {}
  correction = correction_weights(old_logp, rollout_logp, mask, is_correction, is_cap,
                                  segment_ids=segment_ids)
  if correction is not None:
    loss_tok = loss_tok * correction
    metrics["is_weight_mean"] = _masked_mean(correction, w)
  metrics.update(_ratio_metrics(log_ratio, ratio, clip_active, dual_active, w))
  metrics = {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
  return aggregate(loss_tok, mask, agg, norm_len=norm_len, chunks=chunks, weights=weights,
                   segment_ids=segment_ids), metrics


def _sequence_log_ratio(log_ratio: jax.Array, logp: jax.Array, w: jax.Array,
                        segment_ids: jax.Array | None) -> jax.Array:
  """GSPO's per-token log-ratio: the value of the sequence's mean log-ratio on every token, the
  gradient of that token's own logp (sg(mean) + logp - sg(logp); the last two cancel exactly)."""
  seq = (samples.sums(log_ratio * w, segment_ids)
         / jnp.maximum(samples.sums(w, segment_ids), 1.0))
  return jax.lax.stop_gradient(seq) + (logp - jax.lax.stop_gradient(logp))


def _cispo_surrogate(adv: jax.Array, ratio: jax.Array, logp: jax.Array, clip_low: float,
                     clip_high: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(per-token loss, where the ratio was clipped, no dual clip)."""
  clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  loss_tok = -jax.lax.stop_gradient(clipped) * adv * logp
  return loss_tok, clipped != ratio, jnp.zeros(ratio.shape, bool)


def _clipped_surrogate(adv: jax.Array, ratio: jax.Array, clip_low: float, clip_high: float,
                       dual_clip: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(per-token loss, where the clipped branch is active, where the dual clip is active)."""
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  loss_tok = jnp.maximum(unclipped, clipped)
  clip_active = clipped > unclipped
  if dual_clip is None:
    return loss_tok, clip_active, jnp.zeros_like(clip_active)
  cap = -adv * dual_clip
  dual_active = (adv < 0) & (loss_tok > cap)
  return jnp.where(dual_active, cap, loss_tok), clip_active, dual_active


def _ratio_metrics(log_ratio: jax.Array, ratio: jax.Array, clip_active: jax.Array,
                   dual_active: jax.Array, w: jax.Array) -> dict[str, jax.Array]:
  """The policy loss's metrics over policy tokens; an empty batch reports ratio 1 rather than +-inf."""
  any_tok = w.sum() > 0
  return dict(
      clip_frac=_masked_mean(clip_active.astype(_F32), w),
      dual_clip_frac=_masked_mean(dual_active.astype(_F32), w),
      approx_kl=_masked_mean(0.5 * log_ratio**2, w),
      ratio_mean=_masked_mean(ratio, w),
      ratio_max=jnp.where(any_tok, jnp.where(w > 0, ratio, -jnp.inf).max(), 1.0),
      ratio_min=jnp.where(any_tok, jnp.where(w > 0, ratio, jnp.inf).min(), 1.0),
  )


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    *,
    clip_eps: float | None = 0.5,
    agg: str = "token-mean",
    norm_len: int | None = None,
    chunks: int = 1,
    weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped value loss 0.5 * max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2), inputs [B, T].

  clip_eps=None gives the plain 0.5 * (v - R)^2. Metric: vf_clip_frac (the clipped branch is the
  active one). Explained variance is a whole-batch statistic (`explained_variance`), not a
  per-micro-batch one: one row's returns are constant at gamma = 1, so its Var(R) is 0.
  """
  v = values.astype(_F32)
  ret = jax.lax.stop_gradient(returns.astype(_F32))
  w = (mask > 0).astype(_F32)
  err = (v - ret) ** 2
  if clip_eps is None:
    loss_tok = 0.5 * err
    clip_active = jnp.zeros(err.shape, bool)
  else:
    old = jax.lax.stop_gradient(old_values.astype(_F32))
    err_clipped = (jnp.clip(v, old - clip_eps, old + clip_eps) - ret) ** 2
    loss_tok = 0.5 * jnp.maximum(err, err_clipped)
    clip_active = err_clipped > err

  metrics = {"vf_clip_frac": jax.lax.stop_gradient(_masked_mean(clip_active.astype(_F32), w))}
  return aggregate(loss_tok, mask, agg, norm_len=norm_len, chunks=chunks, weights=weights), metrics


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
  """1 - Var(R - v) / Var(R) over the tokens where mask != 0 (0 if Var(R) = 0; ddof cancels)."""
  w = (mask > 0).astype(_F32)
  v, ret = values.astype(_F32), returns.astype(_F32)

  def masked_var(x):
    return _masked_mean((x - _masked_mean(x, w)) ** 2, w)

  var_ret = masked_var(ret)
  explained = 1.0 - masked_var(ret - v) / jnp.where(var_ret > 0, var_ret, 1.0)
  return jnp.where(var_ret > 0, explained, 0.0)


def entropy_from_logits(logits: jax.Array) -> jax.Array:
  """[B, T, V] logits -> [B, T] fp32 entropy of softmax(logits)."""
  x = logits.astype(_F32)
  logz = jax.nn.logsumexp(x, axis=-1)
  return logz - (jax.nn.softmax(x, axis=-1) * x).sum(-1)


def entropy_bonus(
    entropy: jax.Array,
    mask: jax.Array,
    agg: str = "token-mean",
    *,
    norm_len: int | None = None,
    chunks: int = 1,
    weights: jax.Array | None = None,
) -> jax.Array:
  """Aggregated [B, T] entropy; the trainer subtracts coef * this from the loss."""
  return aggregate(entropy, mask, agg, norm_len=norm_len, chunks=chunks, weights=weights)


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
  """Per-token estimate of KL(pi || ref) from samples of pi.

  k1: logp - ref (unbiased, high variance, can be negative); k2: 0.5 * (logp - ref)^2 (biased,
  >= 0); k3: exp(ref - logp) - (ref - logp) - 1 (unbiased and >= 0, low variance).
  """
  d = ref_logp.astype(_F32) - logp.astype(_F32)
  if kind == "k1":
    return -d
  if kind == "k2":
    return 0.5 * d**2
  if kind == "k3":
    return jnp.exp(d) - d - 1.0
  raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


def kl_loss(
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    kind: str = "k3",
    agg: str = "token-mean",
    *,
    norm_len: int | None = None,
    chunks: int = 1,
    weights: jax.Array | None = None,
) -> jax.Array:
  """KL-to-reference as a loss term (GRPO style), aggregated over policy tokens."""
  kl = kl_penalty(logp, jax.lax.stop_gradient(ref_logp), kind)
  return aggregate(kl, mask, agg, norm_len=norm_len, chunks=chunks, weights=weights)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """[B, T, V] logits, [B, T] int targets -> [B, T] fp32 log p(target)."""
  logps = jax.nn.log_softmax(logits.astype(_F32), axis=-1)
  return jnp.take_along_axis(logps, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
