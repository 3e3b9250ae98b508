"""The RLVER training loop: profiles -> rollout -> rewards -> advantages -> fused update -> metrics ->
checkpoint, with periodic evaluation on held-out profiles.

Shape legend for packed batches: N samples (rows), M micro-batches, B rows per micro-batch, T tokens.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding

from rlver_jax import build, provenance
from rlver_jax.checkpoint import Checkpointer, PreemptionGuard, abstract_like
from rlver_jax.env.evaluation import summarize
from rlver_jax.env.profiles import ProfileSampler, repeat_for_groups, split_holdout
from rlver_jax.env.rollout import Dialogue, RolloutInterrupted, RolloutStats, run_dialogues
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.metrics import MetricsWriter
from rlver_jax.rl import advantages as adv_lib
from rlver_jax.rl.losses import explained_variance, kl_penalty
from rlver_jax.rl.update import Updater, make_optimizer, token_logprobs_and_entropy, token_values
from rlver_jax.run_config import (check_inputs_on_every_host, check_shared_workdir, check_workdir_config,
                                  write_workdir_config)
from rlver_jax.shapes import SEQ_MULTIPLE, shape_bucket
from rlver_jax.sharding import DEFAULT_RULES, batch_shards, global_array, host_array
from rlver_jax.train_checks import check_training_config


@dataclasses.dataclass
class Packed:
  """Samples padded into [N, T] arrays (N a multiple of the micro-batch layout)."""
  tokens: np.ndarray
  segment_ids: np.ndarray
  loss_mask: np.ndarray
  rollout_logp: np.ndarray
  rewards: np.ndarray
  dialogue: np.ndarray   # [N] dialogue index per row (-1: padding)
  num_real: int


def pack(dialogues: list[Dialogue], rows_multiple: int, pad_id: int) -> Packed:
  samples = [s for d in dialogues for s in d.samples]
  N = shape_bucket(len(samples), rows_multiple)
  T = shape_bucket(max((len(s.tokens) for s in samples), default=1), SEQ_MULTIPLE)
  out = Packed(np.full((N, T), pad_id, np.int32), np.zeros((N, T), np.int32),
               np.zeros((N, T), np.float32), np.zeros((N, T), np.float32),
               np.zeros((N, T), np.float32), np.full((N,), -1, np.int32), len(samples))
  index = {id(d): i for i, d in enumerate(dialogues)}
  owner = [index[id(d)] for d in dialogues for _ in d.samples]
  for i, s in enumerate(samples):
    L = len(s.tokens)
    out.tokens[i, :L] = s.tokens
    out.segment_ids[i, :L] = 1
    out.loss_mask[i, :L] = s.loss_mask
    out.rollout_logp[i, :L] = s.sampler_logp
    for t, r in s.token_rewards.items():
      out.rewards[i, t] = r
    out.dialogue[i] = owner[i]
  return out


class Trainer:
  """Holds the models, optimizers, samplers and the run's state; `run` drives the loop."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    self.config = config
    self.workdir = workdir
    check_training_config(config)
    check_shared_workdir(workdir)
    check_inputs_on_every_host(build.input_paths(config))
    check_workdir_config(config, workdir)
    self.mesh = build.mesh_from(config)
    profiles = build.profiles_from(config.data.profiles)
    start = provenance.check(config, workdir, profiles)
    self.train_profiles, self.holdout = split_holdout(profiles, config.data.num_holdout, config.seed)
    if not self.train_profiles:
      raise build.ConfigError(f"config.data.num_holdout={config.data.num_holdout} leaves no training "
                              f"profiles out of {len(profiles)}")
    self.profile_sampler = ProfileSampler(self.train_profiles, seed=config.seed)
    with jax.set_mesh(self.mesh):
      self.policy, self.chat, self.policy_path = build.load_policy(config, self.mesh)
      self.sampler = build.policy_sampler(self.policy, self.chat, config, self.mesh)
      self.backend = build.simulator_backend(config, self.mesh)
      loss_cfg = build.loss_config(config)
      self.policy_up = Updater(self.policy, make_optimizer(build.optim_config(config)), "policy", loss_cfg)
      self.state: dict[str, Any] = {"policy": nnx.state(self.policy, nnx.Param)}
      self.state["policy_opt"] = self.policy_up.init(self.state["policy"])
      self.critic = None
      if config.algo == "ppo":
        self.critic = build.load_critic(config, self.mesh, self.policy_path)
        self.critic_up = Updater(self.critic, make_optimizer(build.optim_config(config, critic=True)),
                                 "value", loss_cfg)
        self.state["critic"] = nnx.state(self.critic, nnx.Param)
        self.state["critic_opt"] = self.critic_up.init(self.state["critic"])
      self.ref = (jax.tree.map(jnp.copy, self.state["policy"]) if config.rl.kl_coef > 0 else None)
    # Replicated over the mesh like every other state leaf, so a restored key lives on the same devices.
    self.state["rng"] = global_array(jax.random.key_data(jax.random.key(config.seed)),
                                     NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
    self.step = 0
    self.checkpointer = Checkpointer(workdir, every_steps=config.checkpoint.every_steps,
                                     keep=config.checkpoint.keep)
    self.writer = MetricsWriter(workdir)
    self._logp_fn = jax.jit(self._old_logp)
    self._value_fn = jax.jit(self._old_values)
    write_workdir_config(config, workdir)  # only now: every input above was found and loaded
    provenance.append(workdir, start)

  # -- state -------------------------------------------------------------------------------------

  def restore_if_any(self) -> bool:
    if self.checkpointer.latest_step() is None:
      self.writer.drop_after(0)  # rows of an earlier attempt that never saved: it starts over
      return False
    state, meta = self.checkpointer.restore(abstract_like(self.state))
    self.state = state
    self.step = int(meta["step"])
    self.profile_sampler.load_state_dict(meta["profile_sampler"])
    shards = batch_shards(self.mesh)
    saved = meta.get("batch_shards", shards)  # checkpoints of older versions did not record it
    if shards != saved:  # e.g. mesh.fsdp=-1 on a different slice: training goes on, but differently
      logging.warning("step %d was trained with %d batch shards, this mesh has %d: each micro-batch "
                      "now holds rl.micro_batch_size x %d rows instead of x %d", self.step, saved,
                      shards, shards, saved)
    self.writer.drop_after(self.step)
    logging.info("resumed from step %d", self.step)
    return True

  def save(self) -> None:
    meta = {"step": self.step, "profile_sampler": self.profile_sampler.state_dict(),
            "config": self.config.to_dict(), "batch_shards": batch_shards(self.mesh)}
    self.checkpointer.save(self.step, self.state, meta)

  # -- one step ----------------------------------------------------------------------------------

  def rollout(self, rng, should_stop=None) -> tuple[list[Dialogue], RolloutStats]:
    c = self.config
    # Every host samples the whole global batch (same seed, same order): parsing replies and the
    # simulator's decisions run on the host and need every row's text everywhere. Token ids come
    # back from the devices through `host_array`, so all hosts append the same tokens.
    profiles = self.profile_sampler.next_batch(c.rl.profiles_per_step)
    profiles, groups = repeat_for_groups(profiles, c.rl.group_size)
    s = c.simulator
    _reseed_simulator(self.backend, rng)
    users = SimulatedUsers(profiles, self.backend, style=s.style, start_emotion=s.start_emotion,
                           max_turns=s.max_turns, max_parse_retries=s.max_parse_retries)
    stats = RolloutStats()
    dialogues = run_dialogues(profiles, groups, users, sampler=self.sampler, params=self.state["policy"],
                              chat=self.chat, cfg=build.rollout_config(c), rng=rng, stats=stats,
                              should_stop=should_stop)
    return dialogues, stats

  def _old_logp(self, params, tokens, seg):
    model = nnx.merge(self.policy_up.graphdef, params, self.policy_up.rest)
    return jax.lax.map(lambda a: token_logprobs_and_entropy(model, a[0], a[1],
                                                            self.config.rl.logits_chunk)[0], (tokens, seg))

  def _old_values(self, params, tokens, seg):
    model = nnx.merge(self.critic_up.graphdef, params, self.critic_up.rest)
    return jax.lax.map(lambda a: token_values(model, a[0], a[1]), (tokens, seg))

  def _device(self, x: np.ndarray) -> jax.Array:
    """[M, B, ...] host array -> device array with B over the batch mesh axes."""
    axes = (None, "batch") + (None,) * (x.ndim - 2)
    return global_array(x, NamedSharding(self.mesh, DEFAULT_RULES.spec(axes, x.shape, self.mesh)))

  def make_batch(self, dialogues: list[Dialogue]) -> tuple[dict[str, jax.Array], dict[str, float]]:
    c = self.config
    # micro_batch_size counts rows per batch shard, so every device gets its own rows (a global
    # micro-batch smaller than the shard count would be replicated: the same rows on every device).
    mb, M = c.rl.micro_batch_size * batch_shards(self.mesh), c.rl.mini_batches
    p = pack(dialogues, mb * M, self.chat.pad_id)
    N, T = p.tokens.shape
    shape = (N // mb, mb, T)
    tokens, seg = self._device(p.tokens.reshape(shape)), self._device(p.segment_ids.reshape(shape))
    old_logp = self._logp_fn(self.state["policy"], tokens, seg)
    batch = {"tokens": tokens, "segment_ids": seg, "loss_mask": self._device(p.loss_mask.reshape(shape)),
             "old_logp": old_logp, "rollout_logp": self._device(p.rollout_logp.reshape(shape))}
    mask = p.loss_mask
    extra = {}
    if self.ref is not None:
      ref_logp = host_array(self._logp_fn(self.ref, tokens, seg)).reshape(N, T)
      old = host_array(old_logp).reshape(N, T)
      extra["kl_ref"] = float(((old - ref_logp) * mask).sum() / max(mask.sum(), 1))
      if c.rl.kl_in_reward:
        kl = np.asarray(kl_penalty(jnp.asarray(old), jnp.asarray(ref_logp), c.rl.kl_kind))
        p.rewards -= c.rl.kl_coef * kl * mask
      else:
        batch["ref_logp"] = self._device(ref_logp.reshape(shape))
    rewards = np.array([d.reward for d in dialogues], np.float32)
    if c.algo == "grpo":
      groups = np.array([d.group_id for d in dialogues], np.int32)
      per_dialogue = np.asarray(adv_lib.grpo_advantages(
          jnp.asarray(rewards), jnp.asarray(groups), mean_only=c.rl.grpo_mean_only))
      per_row = np.where(p.dialogue >= 0, per_dialogue[np.maximum(p.dialogue, 0)], 0.0)
      adv = per_row[:, None] * mask
      batch["advantages"] = self._device(adv.reshape(shape).astype(np.float32))
    else:
      values = self._value_fn(self.state["critic"], tokens, seg)
      v = host_array(values).reshape(N, T)
      adv, ret = adv_lib.gae(jnp.asarray(p.rewards), jnp.asarray(v), jnp.asarray(mask),
                             gamma=c.rl.gamma, lam=c.rl.lam)
      if c.rl.whiten_advantages:
        adv = adv_lib.whiten(adv, jnp.asarray(mask))
      batch.update(advantages=self._device(np.asarray(adv).reshape(shape)), old_values=values,
                   returns=self._device(np.asarray(ret).reshape(shape)))
      extra["value_mean"] = float((v * mask).sum() / max(mask.sum(), 1))
      # Over the whole batch at the rollout's values (per micro-batch it would be 0 for every row
      # whose returns are constant, as every row's are at gamma = 1).
      extra["critic/explained_variance"] = float(explained_variance(jnp.asarray(v), ret,
                                                                    jnp.asarray(mask)))
    extra["policy_tokens"] = float(mask.sum())
    extra["samples"] = float(p.num_real)
    extra["sample_tokens"] = float((p.segment_ids > 0).sum())  # real tokens, padding excluded
    return batch, extra

  def update(self, batch: dict[str, jax.Array]) -> dict[str, float]:
    c = self.config
    M = c.rl.mini_batches
    metrics: dict[str, list] = {}
    # Policy tokens per mini-batch: the per-token metrics are averaged with these weights.
    tokens = (host_array(batch["loss_mask"]) > 0).sum(axis=(1, 2))
    # A mini-batch of padding only (fewer samples than micro-batches x mini_batches) is skipped: its
    # gradient is zero, but an AdamW step would still move the weights (momentum, weight decay) and
    # advance the warm-up. (A step without any policy token keeps one, so its metrics exist.)
    parts = [part for part in range(M) if tokens[part::M].sum() > 0] or [0]
    weights = [float(tokens[part::M].sum()) for part in parts] * c.rl.epochs
    for _ in range(c.rl.epochs):
      for part in parts:
        mini = {k: v[part::M] for k, v in batch.items()}
        self.state["policy"], self.state["policy_opt"], m = self.policy_up.step(
            self.state["policy"], self.state["policy_opt"], mini)
        if c.algo == "ppo":
          self.state["critic"], self.state["critic_opt"], mv = self.critic_up.step(
              self.state["critic"], self.state["critic_opt"], mini)
          m = {**m, **{f"critic/{k}": v for k, v in mv.items()}}
        for k, v in m.items():
          metrics.setdefault(k, []).append(float(v))
    w = np.asarray(weights) if sum(weights) > 0 else np.ones(len(weights))
    out = {}
    for k, v in metrics.items():
      if k.endswith("ratio_max") or k.endswith("ratio_min"):
        out[k] = float(np.max(v) if k.endswith("max") else np.min(v))
      elif k.endswith("grad_norm"):  # one value per optimizer update, whatever its size
        out[k] = float(np.mean(v))
      else:
        out[k] = float(np.average(v, weights=w))
    return out

  def train_step(self, should_stop=None) -> dict[str, float]:
    """One rollout + update. `should_stop` is polled between rollout turns; if it fires, the step is
    abandoned before anything changed (RolloutInterrupted) and the state is still the last step's."""
    rng = jax.random.fold_in(jax.random.wrap_key_data(self.state["rng"]), self.step)
    t0 = time.perf_counter()
    before = self.profile_sampler.state_dict()
    with jax.set_mesh(self.mesh):
      try:
        dialogues, stats = self.rollout(rng, should_stop)
      except RolloutInterrupted:
        self.profile_sampler.load_state_dict(before)  # a resume redoes this step's batch
        raise
      t1 = time.perf_counter()
      batch, extra = self.make_batch(dialogues)
      metrics = self.update(batch)
    jax.block_until_ready(self.state["policy"])
    t2 = time.perf_counter()
    self.step += 1
    self._last_dialogues = dialogues
    out = summarize_rollout(dialogues)
    out.update(metrics)
    out.update(extra)
    out.update(rollout_seconds=t1 - t0, update_seconds=t2 - t1,
               rollout_fraction=(t1 - t0) / max(t2 - t0, 1e-9),
               rollout_policy_tokens_per_s=stats.policy_tokens / max(t1 - t0, 1e-9),
               update_tokens_per_s=extra["sample_tokens"] * self.config.rl.epochs / max(t2 - t1, 1e-9))
    return out


def summarize_rollout(dialogues: list[Dialogue]) -> dict[str, float]:
  rewards = np.array([d.reward for d in dialogues])
  s = summarize(dialogues)
  out = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
         "final_emotion_mean": s["score"], "success_rate": s["success_rate"],
         "failure_rate": s["failure_rate"], "positive_rate": s["positive_rate"],
         "turns_mean": s["mean_turns"], "parse_failures": float(s["parse_failures"]),
         "reply_failures": float(s["reply_failures"]), "silent_replies": float(s["silent_replies"]),
         "format_violation_rate": float(np.mean([not all(d.format_ok) for d in dialogues]))}
  for reason, n in s["terminations"].items():
    out[f"termination/{reason}"] = n / len(dialogues)
  return out


_SIMULATOR_STREAM = 0x51A  # fold_in tag: the simulator's key, apart from the policy's


def _reseed_simulator(backend, rng) -> None:
  """A sampling simulator draws from a key derived from `rng` (the step's key, restored on resume),
  not from a stream it advanced itself: resumed runs repeat it, and evaluations do not shift it."""
  reseed = getattr(backend, "reseed", None)
  if reseed is not None:
    reseed(jax.random.fold_in(rng, _SIMULATOR_STREAM))


def evaluate_holdout(trainer: Trainer, rng, should_stop=None) -> dict:
  """The current policy on the held-out profiles, with the evaluation start emotion and turn limit.
  `should_stop` is polled between turns (RolloutInterrupted when it fires)."""
  c = trainer.config
  profiles = trainer.holdout[: c.eval.num_profiles or None]  # 0 = all, as in the eval config
  _reseed_simulator(trainer.backend, rng)
  users = SimulatedUsers(profiles, trainer.backend, style=c.simulator.style,
                         start_emotion=c.eval.start_emotion, max_turns=c.eval.max_turns,
                         max_parse_retries=c.simulator.max_parse_retries)
  with jax.set_mesh(trainer.mesh):
    dialogues = run_dialogues(profiles, list(range(len(profiles))), users, sampler=trainer.sampler,
                              params=trainer.state["policy"], chat=trainer.chat,
                              cfg=build.holdout_rollout_config(c), rng=rng, should_stop=should_stop)
  s = summarize(dialogues)
  return {f"eval/{k}": s[k] for k in ("score", "success_rate", "failure_rate", "mean_turns")}


def _eval_key(config) -> jax.Array:
  return jax.random.key(config.seed + 7)


def _evaluation_missing(trainer: Trainer) -> bool:
  """Whether the restored step is an evaluation step whose row has no evaluation (every host reads
  the same shared metrics.jsonl, so all agree)."""
  every, step = trainer.config.eval.every_steps, trainer.step
  if not every or step == 0 or step % every:
    return False
  row = next((r for r in trainer.writer.history() if r.get("step") == step), None)
  return row is not None and "eval/score" not in row


class TrainingDiverged(RuntimeError):
  pass


def check_finite_update(step: int, metrics: dict[str, float], last_saved: int | None) -> None:
  """Stops a run whose update produced a non-finite loss or gradient, before it saves the broken
  weights: with checkpoint.keep rotating, the good ones would soon be gone."""
  for k in ("loss", "grad_norm", "critic/loss", "critic/grad_norm"):
    if k in metrics and not np.isfinite(metrics[k]):
      saved = f"step {last_saved}" if last_saved is not None else "nothing yet"
      raise TrainingDiverged(f"step {step}: {k}={metrics[k]} after the update (training diverged); "
                             f"stopped without saving it, the last checkpoint holds {saved}")


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, str]:
  """Trains until config.total_steps (resuming from WORKDIR/checkpoints); returns output paths."""
  from tqdm import tqdm
  trainer = Trainer(config, workdir)
  trainer.restore_if_any()
  total = config.total_steps
  bar = tqdm(total=total, initial=trainer.step, desc="rlver", disable=not config.log.progress_bar
             or jax.process_index() != 0)
  # finally: an error mid-run still completes the checkpoint saves already started (they are async).
  try:
    with PreemptionGuard() as guard:
      stopped = False
      if _evaluation_missing(trainer):
        # The step was saved, then its evaluation was cut short (a crash or SIGTERM): redo it.
        try:
          trainer.writer.write(trainer.step, evaluate_holdout(trainer, _eval_key(config), guard.agreed),
                               merge=True)
        except RolloutInterrupted:
          logging.warning("SIGTERM during the evaluation of step %d, exiting", trainer.step)
          stopped = True
      while trainer.step < total and not stopped:
        try:
          # Polled between turns too: a rollout takes minutes and a preemption notice ~30 s.
          metrics = trainer.train_step(should_stop=guard.agreed)
        except RolloutInterrupted:
          if trainer.step > 0:  # step 0 is the pretrained start: nothing to keep
            trainer.save()
          logging.warning("SIGTERM during the rollout of step %d: saved step %d, exiting",
                          trainer.step + 1, trainer.step)
          break
        step = trainer.step
        trainer.writer.write(step, metrics)
        check_finite_update(step, metrics, trainer.checkpointer.latest_step())
        if config.log.transcripts_every and step % config.log.transcripts_every == 0:
          trainer.writer.write_transcripts(step, [d.transcript() for d in trainer._last_dialogues])
        preempted = guard.agreed()
        # Saved before the held-out evaluation: an evaluation that fails (e.g. its simulator server
        # is down) must not cost the step, and a preempted run has no time for one.
        if trainer.checkpointer.should_save(step, total) or preempted:
          trainer.save()
        if preempted:
          logging.warning("SIGTERM: saved step %d, exiting", step)
          break
        if config.eval.every_steps and step % config.eval.every_steps == 0:
          try:  # minutes long: a preemption notice (~30 s of grace) must not wait for its end
            scores = evaluate_holdout(trainer, _eval_key(config), guard.agreed)
          except RolloutInterrupted:
            trainer.save()  # no-op if this step was just saved
            logging.warning("SIGTERM during the evaluation after step %d: saved it, exiting", step)
            break
          trainer.writer.write(step, scores, merge=True)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                        emotion=f"{metrics['final_emotion_mean']:.1f}")
  finally:
    bar.close()
    trainer.checkpointer.close()
  plot = trainer.writer.plot_rewards()
  trainer.writer.close()
  return {"metrics": str(trainer.writer.path), "checkpoints": str(trainer.checkpointer.directory),
          "transcripts": str(trainer.writer.transcripts), "reward_plot": str(plot),
          "tensorboard": f"{workdir}/tensorboard", "step": str(trainer.step)}
