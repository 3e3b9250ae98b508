"""The fused PPO / GRPO update: one jitted, donated step per mini-batch.

Shape legend: M micro-batches, B sequences per micro-batch, T tokens, V vocabulary, D hidden.

The step takes an `rl.batch.UpdateBatch` (a pytree, passed to jit and scanned over micro-batches as
it is): token-aligned [M, B, T] arrays, index t describing token t (`logp[..., t] = log p(tokens[t] |
tokens[<t])`; index 0 is never a policy token). `loss_mask` is 1 on tokens the policy sampled.
Loss terms are reduced with weights computed once over the whole mini-batch, so accumulating
gradients over micro-batches (a `lax.scan` inside the jit) gives exactly the gradient of the whole
mini-batch. The step is a module-level function jitted once per (model structure, optimizer, loss,
loss config), so every updater of one configuration runs one compiled program.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlver_jax.models.qwen2 import Qwen2
from rlver_jax.rl import losses, samples
from rlver_jax.rl.batch import UpdateBatch

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class LossConfig:
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float | None = None
  agg: str = "token-mean"
  norm_len: int | None = None
  chunks: int = 1               # chunk-token-mean's runs (rl.loss_agg_chunks)
  entropy_coef: float = 0.001
  kl_coef: float = 0.0          # KL-to-reference in the loss (0: off, as in the paper)
  kl_kind: str = "k3"
  policy_loss: str = "ppo"      # rl.losses.POLICY_LOSSES
  is_correction: str = "none"   # sampler/trainer mismatch correction (rl.rollout_correction)
  is_cap: float | None = None   # its cap c (needed unless is_correction is "none")
  value_clip: float | None = 0.5
  logits_chunk: int = 512       # tokens per LM-head chunk: bounds the [B, T, V] fp32 logits


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 1e-6
  warmup_steps: int = 0
  b1: float = 0.9
  b2: float = 0.999
  weight_decay: float = 0.01
  grad_clip: float = 1.0


@functools.lru_cache(maxsize=None)
def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  """Clip by global norm (grad_clip > 0; 0 = off), then AdamW with a linear warm-up to a constant
  learning rate. One object per config, so updaters of equal configs share their program."""
  schedule = optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1)),
       optax.constant_schedule(cfg.learning_rate)], [max(cfg.warmup_steps, 1)])
  if cfg.warmup_steps <= 0:
    schedule = optax.constant_schedule(cfg.learning_rate)
  if cfg.grad_clip < 0:
    raise ValueError(f"grad_clip={cfg.grad_clip}: must be >= 0 (0 = off)")
  # identity() keeps the chain's state layout, so a checkpoint does not depend on the setting.
  clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
  return optax.chain(clip,
                     optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


def _shifted(hidden_BxTxD: jax.Array) -> jax.Array:
  """Hidden state that predicts token t sits at t - 1: shift right, zeros at t = 0."""
  return jnp.pad(hidden_BxTxD[:, :-1], ((0, 0), (1, 0), (0, 0)))


def _hidden(model: Qwen2, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array) -> jax.Array:
  """Hidden states with each packed sample at the positions it has alone (`rl.samples`)."""
  return model.hidden_states(tokens_BxT, samples.positions(segment_ids_BxT), segment_ids_BxT)


def token_logprobs_and_entropy(model: Qwen2, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array,
                               chunk: int) -> tuple[jax.Array, jax.Array]:
  """log p(token t | <t) and the entropy of that prediction, both [B, T] fp32 (0 at a sample's
  first token: nothing of its own predicts it).

  The LM head runs over chunks of `chunk` positions under remat, so the full [B, T, V] logits are
  never alive at once in the forward or the backward pass.
  """
  hidden = _shifted(_hidden(model, tokens_BxT, segment_ids_BxT))
  B, T, D = hidden.shape
  n = -(-T // chunk)
  pad = n * chunk - T
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, D).swapaxes(0, 1)
  tgt = jnp.pad(tokens_BxT, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one(args):
    h_c, t_c = args
    logits = model.logits(h_c)
    return losses.token_logprobs(logits, t_c), losses.entropy_from_logits(logits)

  logp, ent = jax.lax.map(one, (h, tgt))
  logp = logp.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]
  ent = ent.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]
  later = ~samples.starts(segment_ids_BxT)
  return jnp.where(later, logp, 0.0), jnp.where(later, ent, 0.0)


def token_values(critic: Qwen2, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array) -> jax.Array:
  """V(state before token t), [B, T] fp32 (0 at a sample's first token; the padding slot after a
  sample holds the value after its last token)."""
  values = critic.values(_shifted(_hidden(critic, tokens_BxT, segment_ids_BxT)))
  return jnp.where(samples.starts(segment_ids_BxT), 0.0, values)


def _policy_loss(model: Qwen2, mb: UpdateBatch, cfg: LossConfig):
  logp, ent = token_logprobs_and_entropy(model, mb.tokens, mb.segment_ids, cfg.logits_chunk)
  w = mb.weights
  loss, metrics = losses.policy_loss(
      logp, mb.old_logp, mb.advantages, mb.loss_mask, kind=cfg.policy_loss, clip_low=cfg.clip_low,
      clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, rollout_logp=mb.rollout_logp,
      is_correction=cfg.is_correction, is_cap=cfg.is_cap, weights=w, segment_ids=mb.segment_ids)
  entropy = losses.entropy_bonus(ent, mb.loss_mask, weights=w)
  total = loss - cfg.entropy_coef * entropy
  metrics = dict(metrics, pg_loss=loss, entropy=entropy)
  if cfg.kl_coef > 0:
    kl = losses.kl_loss(logp, mb.ref_logp, mb.loss_mask, cfg.kl_kind, weights=w)
    total = total + cfg.kl_coef * kl
    metrics["kl_loss"] = kl
  return total, metrics


def _value_loss(critic: Qwen2, mb: UpdateBatch, cfg: LossConfig):
  values = token_values(critic, mb.tokens, mb.segment_ids)
  loss, metrics = losses.value_loss(values, mb.old_values, mb.returns, mb.trained_mask("value"),
                                    clip_eps=cfg.value_clip, weights=mb.weights)
  return loss, dict(metrics, vf_loss=loss)


LOSSES = {"policy": _policy_loss, "value": _value_loss}


def opt_state_shardings(optimizer: optax.GradientTransformation, params, mesh: Mesh):
  """Shardings of `optimizer.init(params)`: param-like leaves (moments) as their params, the rest
  (step counts) replicated. `params` may be arrays or sharded ShapeDtypeStructs."""
  state = jax.eval_shape(optimizer.init, params)
  whole = NamedSharding(mesh, PartitionSpec())
  return optax.tree_map_params(optimizer, lambda _, p: p.sharding, state, params,
                               transform_non_params=lambda _: whole)


@functools.lru_cache(maxsize=None)
def update_program(graphdef, optimizer: optax.GradientTransformation, loss: str, cfg: LossConfig):
  """The jitted update step for a model structure, optimizer, loss and loss config:
  (params, opt_state, rest, batch, lr_scale=None) -> (params, opt_state, metrics), params and
  optimizer state donated. One program per distinct configuration, shared by every `Updater` that
  has it (jit caches its compiled programs on the function object)."""
  return jax.jit(functools.partial(_update_step, graphdef, optimizer, LOSSES[loss], cfg),
                 donate_argnums=(0, 1))


def _update_step(graphdef, optimizer, loss_fn, cfg: LossConfig, params, opt_state, rest,
                 batch: UpdateBatch, lr_scale: jax.Array | None = None):
  """One optimizer update on a mini-batch; `lr_scale` is a scalar, not scanned over micro-batches
  like `batch`."""
  def loss_of(p, mb):
    return loss_fn(nnx.merge(graphdef, p, rest), mb, cfg)

  grad_fn = jax.value_and_grad(loss_of, has_aux=True)

  def accumulate(grads, mb):
    (loss, metrics), g = grad_fn(params, mb)
    return jax.tree.map(jnp.add, grads, g), dict(metrics, loss=loss)

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, _F32), params)
  grads, per_mb = jax.lax.scan(accumulate, zeros, batch)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  if lr_scale is not None:  # AdamW's update is linear in the learning rate
    updates = jax.tree.map(lambda u: (u * lr_scale).astype(u.dtype), updates)
  params = optax.apply_updates(params, updates)
  return params, opt_state, _step_metrics(per_mb, batch, grads, value=loss_fn is _value_loss)


def _step_metrics(per_mb: dict, batch: UpdateBatch, grads, value: bool) -> dict[str, jax.Array]:
  """The update's metrics from the per-micro-batch ones. Loss terms are already weighted over the
  whole mini-batch: summed. The others are per-token means of each micro-batch: weighted by its
  token count, so a short or all-padding micro-batch does not count as much as a full one."""
  summed = {"loss", "pg_loss", "entropy", "kl_loss", "vf_loss"}
  counts = (batch.trained_mask("value" if value else "policy") > 0).sum(axis=(1, 2)).astype(_F32)
  per_token = lambda v: (v * counts).sum() / jnp.maximum(counts.sum(), 1.0)
  metrics = {k: (v.sum() if k in summed else per_token(v)) for k, v in per_mb.items()}
  if "ratio_max" in metrics:
    has, any_tok = counts > 0, counts.sum() > 0
    metrics["ratio_max"] = jnp.where(any_tok, jnp.where(has, per_mb["ratio_max"], -jnp.inf).max(), 1.0)
    metrics["ratio_min"] = jnp.where(any_tok, jnp.where(has, per_mb["ratio_min"], jnp.inf).min(), 1.0)
  metrics["grad_norm"] = optax.tree.norm(grads)
  return metrics


@dataclasses.dataclass(frozen=True)
class _Step:
  """An `update_program` with the model's non-parameter state bound: called as the trainer calls
  it, lowered as the ahead-of-time planner lowers it."""
  program: Any
  rest: Any

  def __call__(self, params, opt_state, batch: UpdateBatch, lr_scale=None):
    return self.program(params, opt_state, self.rest, batch, lr_scale)

  def lower(self, params, opt_state, batch: UpdateBatch, lr_scale=None):
    return self.program.lower(params, opt_state, self.rest, batch, lr_scale)


class Updater:
  """A model's (policy or critic) update: its optimizer and the shared, donated `update_program`."""

  def __init__(self, model: Qwen2, optimizer: optax.GradientTransformation, loss: str, cfg: LossConfig):
    self.graphdef, _, self.rest = nnx.split(model, nnx.Param, ...)
    self.optimizer = optimizer
    self.loss = loss
    self.cfg = cfg
    self._step = _Step(update_program(self.graphdef, optimizer, loss, cfg), self.rest)

  def init(self, params: nnx.State) -> Any:
    """The optimizer state, its moments sharded like the params (jit alone would replicate them:
    `zeros_like` does not inherit a sharding, and Adam's two moments of a 7B policy are 56 GB)."""
    sharding = jax.tree.leaves(params)[0].sharding
    if not isinstance(sharding, NamedSharding):
      return jax.jit(self.optimizer.init)(params)
    shardings = opt_state_shardings(self.optimizer, params, sharding.mesh)
    return jax.jit(self.optimizer.init, out_shardings=shardings)(params)

  def step(self, params: nnx.State, opt_state, batch: UpdateBatch, lr_scale: float | None = None):
    """One optimizer update on a mini-batch ([M, B, T] arrays); returns (params, opt_state, metrics),
    the metrics still on device. `lr_scale` multiplies this update (a warm-up the caller counts in
    its own unit, e.g. RL steps; traced, no recompile). None is 1.0 in the same program: XLA
    compiles a program with the multiply and one without differently upstream too (reduction
    orders), so they would not agree bit for bit."""
    scale = jnp.asarray(1.0 if lr_scale is None else lr_scale, _F32)
    return self._step(params, opt_state, self.weighted(batch), scale)

  def weighted(self, batch: UpdateBatch) -> UpdateBatch:
    """`batch` with its loss weights, computed once over the whole mini-batch (what `_step` takes)."""
    mask = batch.trained_mask(self.loss)
    T = mask.shape[-1]
    weights = losses.token_weights(mask.reshape(-1, T), self.cfg.agg, norm_len=self.cfg.norm_len,
                                   chunks=self.cfg.chunks,
                                   segment_ids=batch.segment_ids.reshape(-1, T))
    return dataclasses.replace(batch, weights=weights.reshape(mask.shape))
