"""The Trainer: the run's models, optimizers and state, and one training step (rollout -> batch ->
update -> metrics). `train.loop` drives the steps; `train.holdout` evaluates between them.

Shape legend for packed batches: N samples (rows), M micro-batches, B rows per micro-batch, T tokens.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding

from rlver_jax import build
from rlver_jax.env.backends import SimulatorBackendError, failure_context
from rlver_jax.env.profiles import ProfileSampler, repeat_for_groups, split_holdout
from rlver_jax.env.rollout import Dialogue, RolloutInterrupted, RolloutStats, run_dialogues
from rlver_jax.env.simulator import SIMULATOR_ERROR, SimulatedUsers
from rlver_jax.evaluation.scoring import summarize
from rlver_jax.parallel.sharding import batch_shards, global_array, host_array
from rlver_jax.rl.batch import UpdateBatch, to_device
from rlver_jax.rl.pack import Packed, pack_step
from rlver_jax.rl.prepare import batch_metrics, kl_penalised_rewards, reference_kl
from rlver_jax.rl.rollout_correction import mismatch_metrics
from rlver_jax.rl.update import token_logprobs_and_entropy, token_values
from rlver_jax.run import start
from rlver_jax.run.checkpoint import Checkpointer, abstract_like
from rlver_jax.run.metrics import MetricsWriter
from rlver_jax.run.saved_config import config_json
from rlver_jax.run.wandb_writer import WandbOptions
from rlver_jax.spec import RunSpec
from rlver_jax.train.dynamic_sampling import Round, StepRollout, fill_informative
from rlver_jax.train.call_metrics import take_sampler_calls, update_calls
from rlver_jax.train.state import TrainState


class StepResult(NamedTuple):
  """What a training step made: its metrics row and its dialogues (every round's, trained or not)."""
  metrics: dict[str, float]
  dialogues: list[Dialogue]


def start_trainer(spec: RunSpec, workdir: str, parts: build.RunParts | None = None) -> "Trainer":
  """A run's start: the workdir's checks before anything loads (`run.start`), the profiles, the
  run's parts (`build.assemble`, or `parts` already assembled for this spec), the Trainer, and only
  then config.json and provenance.json."""
  start.check_before_loading(spec, workdir, build.input_paths(spec))
  profiles = build.profiles_from(spec.data.profiles)
  recorded = start.provenance_of(spec, workdir, profiles)
  trainer = Trainer(spec, parts if parts is not None else build.assemble(spec), profiles, workdir)
  start.record_start(spec, workdir, recorded, trainer.layouts)
  return trainer


class Trainer:
  """Trains: holds the run's parts, its state (parameters, optimizer states, the step) and its
  checkpoint and metrics writers; `train.loop` drives the steps."""

  def __init__(self, spec: RunSpec, parts: build.RunParts, profiles: list, workdir: str):
    """`profiles` split into training and held-out ones; the state initialised from the parts'
    models; checkpoints and metrics under `workdir` (checked beforehand: `start_trainer`)."""
    self.spec = spec
    self.algorithm = spec.algorithm
    self.workdir = workdir
    self.train_profiles, self.holdout = split_holdout(profiles, spec.data.num_holdout, spec.seed)
    if not self.train_profiles:
      raise build.ConfigError(f"config.data.num_holdout={spec.data.num_holdout} leaves no training "
                              f"profiles out of {len(profiles)}")
    self.profile_sampler = ProfileSampler(self.train_profiles, seed=spec.seed,
                                          sampling=spec.data.sampling)
    self.parts = p = parts
    self.mesh, self.layouts = p.mesh, p.layouts
    self.policy, self.chat, self.policy_path = p.policy, p.chat, p.policy_path
    self.decode_copy, self.sampler, self.backend = p.decode_copy, p.sampler, p.backend
    self.policy_up, self.critic, self.critic_up = p.policy_up, p.critic, p.critic_up
    with jax.set_mesh(self.mesh):
      self.state = self._init_state()
    self._refresh_rollout_copy()
    self.step = 0
    # Held while the state changes (the update donates it) and while a step's outputs are written:
    # a save on SIGTERM from the watcher thread waits for it, so it sees one whole step.
    self.lock = threading.RLock()
    self.recorded_step = 0  # the last step whose metrics row is written (what a save may hold)
    self._sampler_after_step = self.profile_sampler.state_dict()
    self.checkpointer = Checkpointer(workdir, every_steps=spec.checkpoint.every_steps,
                                     keep=spec.checkpoint.keep)
    self.writer = MetricsWriter(workdir, wandb=wandb_options(spec))
    self._logp_fn = jax.jit(self._old_logp)
    self._value_fn = jax.jit(self._old_values)

  def _init_state(self) -> TrainState:
    """The trained parameters and their optimizer states (the critic's if there is one), a frozen
    reference copy of the policy if a KL term needs it, and the run's key."""
    policy = nnx.state(self.policy, nnx.Param)
    critic = None if self.critic is None else nnx.state(self.critic, nnx.Param)
    # Replicated over the mesh like every other state leaf, so a restored key lives on the same devices.
    rng = global_array(jax.random.key_data(jax.random.key(self.spec.seed)),
                       NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
    return TrainState(
        policy=policy, policy_opt=self.policy_up.init(policy), rng=rng, critic=critic,
        critic_opt=None if critic is None else self.critic_up.init(critic),
        reference=jax.tree.map(jnp.copy, policy) if self.spec.rl.kl_coef > 0 else None)

  def _refresh_rollout_copy(self) -> None:
    """The state's policy copied into the rollout's layout; the old copy is dropped first, so the
    old and new copies never coexist."""
    self.state = dataclasses.replace(self.state, rollout=None)
    self.state = dataclasses.replace(self.state,
                                     rollout=self.decode_copy.refresh(self.state.policy))

  @property
  def ref(self):
    """The frozen reference policy's parameters (None without a KL term)."""
    return self.state.reference

  @property
  def rollout_params(self):
    """The policy's parameters in the rollout's layout."""
    return self.state.rollout

  # -- state -------------------------------------------------------------------------------------

  def restore_if_any(self) -> bool:
    restored = self.checkpointer.restore_newest_good(abstract_like(self.state.checkpointed()))
    if restored is None:
      self.writer.drop_after(0)  # rows of an earlier attempt that never saved: it starts over
      return False
    state, meta = restored
    self.state = self.state.restored(state)
    self._refresh_rollout_copy()
    self.step = int(meta["step"])
    self.profile_sampler.load_state_dict(meta["profile_sampler"])
    self._sampler_after_step = self.profile_sampler.state_dict()
    self.recorded_step = self.step
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
    meta = {"step": self.step, "profile_sampler": self._sampler_after_step,
            "config": self.spec.source, "batch_shards": batch_shards(self.mesh)}
    self.checkpointer.save(self.step, self.state.checkpointed(), meta)

  # -- one step ----------------------------------------------------------------------------------

  def rollout(self, rng, should_stop=None) -> tuple[list[Dialogue], RolloutStats]:
    rl, s = self.spec.rl, self.spec.simulator
    # Every host samples the whole global batch (same seed, same order): parsing replies and the
    # simulator's decisions run on the host and need every row's text everywhere. Token ids come
    # back from the devices through `host_array`, so all hosts append the same tokens.
    profiles = self.profile_sampler.next_batch(rl.profiles_per_step)
    profiles, groups = repeat_for_groups(profiles, rl.group_size)
    reseed_simulator(self.backend, rng)
    users = SimulatedUsers.playing(profiles, self.backend, s.user_rules(),
                                   groups=groups if rl.shared_opening else None)
    stats = RolloutStats()
    sim_before = self.backend.prefill_tokens  # the co-located model's count (else None)
    cut_before = self.backend.cut_answers
    dialogues = run_dialogues(profiles, groups, users, sampler=self.sampler, params=self.rollout_params,
                              chat=self.chat, cfg=self.spec.rollout_config(), rng=rng, stats=stats,
                              should_stop=should_stop)
    if sim_before is not None:
      stats.simulator_prefill_tokens = self.backend.prefill_tokens - sim_before
    if cut_before is not None:
      stats.simulator_cut_answers = self.backend.cut_answers - cut_before
    return dialogues, stats

  def _old_logp(self, params, tokens, seg):
    model = nnx.merge(self.policy_up.graphdef, params, self.policy_up.rest)
    return jax.lax.map(lambda a: token_logprobs_and_entropy(model, a[0], a[1],
                                                            self.spec.rl.logits_chunk)[0], (tokens, seg))

  def _old_values(self, params, tokens, seg):
    model = nnx.merge(self.critic_up.graphdef, params, self.critic_up.rest)
    return jax.lax.map(lambda a: token_values(model, a[0], a[1]), (tokens, seg))

  def make_batch(self, dialogues: list[Dialogue]) -> tuple[UpdateBatch, dict[str, float]]:
    """The step's update batch from its dialogues (packed, placed, scored by the models), and the
    batch's metrics."""
    rl = self.spec.rl
    # micro_batch_size counts rows per batch shard, so every device gets its own rows (a global
    # micro-batch smaller than the shard count would be replicated: the same rows on every device).
    shards = batch_shards(self.mesh)
    p = pack_step(dialogues, rl.micro_batch_size * shards, self.chat.pad_id,
                  mini_batch_rows=rl.rows_per_mini_batch, mini_batches=rl.mini_batches, shards=shards,
                  pack_length=rl.update_pack_length)
    device = lambda x: to_device(x.reshape(p.layout.step_shape), self.mesh)
    tokens, seg = device(p.tokens), device(p.segment_ids)
    old_logp = self._logp_fn(self.state.policy, tokens, seg)
    rewards, ref_logp, metrics = self._reference(p, tokens, seg, old_logp)
    metrics.update(mismatch_metrics(host_array(old_logp), p.rollout_logp, p.loss_mask,
                                    cap=rl.correction[1], segment_ids=p.segment_ids))
    values = None
    if self.algorithm.has_critic:
      values = self._value_fn(self.state.critic, tokens, seg)
    target = self.algorithm.targets(
        dialogues, p, rewards, None if values is None else host_array(values).reshape(p.loss_mask.shape))
    metrics.update(target.metrics)
    batch = UpdateBatch(tokens=tokens, segment_ids=seg, loss_mask=device(p.loss_mask),
                        old_logp=old_logp, advantages=device(target.advantages),
                        rollout_logp=device(p.rollout_logp),
                        ref_logp=None if ref_logp is None else device(ref_logp), old_values=values,
                        returns=None if target.returns is None else device(target.returns),
                        value_mask=None if target.value_mask is None else device(target.value_mask),
                        mini_batches=p.layout.mini_batches)
    return batch, {**metrics, **batch_metrics(p)}

  def _reference(self, p: Packed, tokens: jax.Array, seg: jax.Array, old_logp: jax.Array
                 ) -> tuple[np.ndarray, np.ndarray | None, dict[str, float]]:
    """With a reference policy: (rewards, its log-probs for a KL term in the loss or None when the
    KL goes into the rewards, the kl_ref metric). Without one: (rewards, None, {})."""
    if self.ref is None:
      return p.rewards, None, {}
    rl = self.spec.rl
    ref_logp = host_array(self._logp_fn(self.ref, tokens, seg)).reshape(p.loss_mask.shape)
    old = host_array(old_logp).reshape(p.loss_mask.shape)
    metrics = {"kl_ref": reference_kl(old, ref_logp, p.loss_mask)}
    if rl.kl_in_reward:
      rewards = kl_penalised_rewards(p.rewards, old, ref_logp, p.loss_mask, coef=rl.kl_coef,
                                     kind=rl.kl_kind)
      return rewards, None, metrics
    return p.rewards, ref_logp, metrics

  def update(self, batch: UpdateBatch) -> dict[str, float]:
    """One optimizer update per mini-batch and epoch (`batch.mini_batches`, from make_batch); the
    metrics of every update are fetched once, after the last is dispatched."""
    M = batch.mini_batches
    # Policy tokens per micro-batch, fetched before the loop: they pick the mini-batches to run and
    # weigh the per-token metrics. A mini-batch of padding only (fewer samples than micro-batches x
    # mini_batches) is skipped: its gradient is zero, but an AdamW step would still move the weights
    # (momentum, weight decay) and advance the warm-up. (A step without any policy token keeps one,
    # so its metrics exist.)
    tokens = host_array(jnp.sum(batch.loss_mask > 0, axis=(1, 2)))
    parts = [part for part in range(M) if tokens[part::M].sum() > 0] or [0]
    per_update = jax.device_get(self.dispatch_updates(batch, parts))
    weights = [float(tokens[part::M].sum()) for part in parts] * self.spec.rl.epochs
    return update_metrics(per_update, weights)

  def dispatch_updates(self, batch: UpdateBatch, parts: list[int]) -> list[dict[str, jax.Array]]:
    """Runs the optimizer updates of mini-batches `parts` for every epoch, without waiting for any:
    the metrics of each update, still on device."""
    scale, critic_scale = self._step_warmup(), self._step_warmup(critic=True)
    out, s = [], self.state
    for _ in range(self.spec.rl.epochs):
      for part in parts:
        mini = batch.mini_batch(part)
        # Each update donates the state it reads: the trainer holds the new one at once, never
        # buffers already given away (a save after a failing critic step would read them).
        policy, policy_opt, m = self.policy_up.step(s.policy, s.policy_opt, mini, lr_scale=scale)
        self.state = s = dataclasses.replace(s, policy=policy, policy_opt=policy_opt)
        if self.algorithm.has_critic:
          critic, critic_opt, mv = self.critic_up.step(s.critic, s.critic_opt, mini,
                                                       lr_scale=critic_scale)
          self.state = s = dataclasses.replace(s, critic=critic, critic_opt=critic_opt)
          m = {**m, **{f"critic/{k}": v for k, v in mv.items()}}
        out.append(m)
    return out

  def _step_warmup(self, critic: bool = False) -> float | None:
    """With optim.warmup_unit = "steps" (the reference's), the learning rate's fraction for this RL
    step: step / warmup over the first `warmup` steps, then 1 (None: the optimizer counts updates)."""
    if self.spec.optim.warmup_unit != "steps":
      return None
    warmup = self.spec.optim.warmup(critic)
    return min(self.step / warmup, 1.0) if warmup > 0 else 1.0

  def _without_simulator_errors(self, dialogues: list[Dialogue]) -> list[Dialogue]:
    """The dialogues to train on: those a failed simulator request cut short get no loss weight and
    stay out of the group statistics. Too many of them stop the run (TooManySimulatorErrors)."""
    trained = [d for d in dialogues if d.termination != SIMULATOR_ERROR]
    failed, limit = len(dialogues) - len(trained), self.spec.simulator.max_failed_share
    if failed and (failed > limit * len(dialogues) or not trained):
      raise TooManySimulatorErrors(
          f"step {self.step + 1}: {failed} of {len(dialogues)} dialogues ({failed / len(dialogues):.0%}) "
          f"ended with simulator_error, more than simulator.max_failed_share={limit:g}; "
          f"{failure_context(self.backend)}")
    return trained

  def _step_rollout(self, rng, should_stop) -> StepRollout:
    """The step's dialogues: one rollout, or with rl.dynamic_sampling as many rounds as it takes to
    fill the batch with informative groups (`train.dynamic_sampling`)."""
    dialogues, stats = self.rollout(rng, should_stop)
    first = Round(dialogues, self._without_simulator_errors(dialogues), stats)
    rl = self.spec.rl
    if not rl.dynamic_sampling:
      return StepRollout.plain(first)

    def another(r: int) -> Round:
      more, more_stats = self.rollout(jax.random.fold_in(rng, _EXTRA_ROUND_STREAM + r), should_stop)
      return Round(more, self._without_simulator_errors(more), more_stats)

    return fill_informative(first, another, self.algorithm.informative_groups,
                            groups=rl.profiles_per_step, max_rounds=rl.dynamic_sampling_max_rounds)

  def train_step(self, should_stop=None) -> StepResult:
    """One rollout + update: the step's metrics and dialogues. `should_stop` is polled between
    rollout turns; if it fires, the step is abandoned before anything changed (RolloutInterrupted)
    and the state is still the last step's."""
    rng = jax.random.fold_in(jax.random.wrap_key_data(self.state.rng), self.step)
    t0 = time.perf_counter()
    before = self.profile_sampler.state_dict()
    self.backend.take_counts()  # zeroed: the step's metrics count the step's HTTP requests
    take_sampler_calls(self.sampler, self.backend)  # zeroed too (a held-out evaluation ran them)
    with jax.set_mesh(self.mesh):
      try:
        rolled = self._step_rollout(rng, should_stop)
      except (RolloutInterrupted, TooManySimulatorErrors):
        self.profile_sampler.load_state_dict(before)  # a resume redoes this step's batch
        raise
      t1 = time.perf_counter()
      calls = take_sampler_calls(self.sampler, self.backend)
      with self.lock:
        batch, extra = self.make_batch(rolled.trained)
        metrics = self.update(batch)
        jax.block_until_ready(self.state.policy)
        self._refresh_rollout_copy()
        metrics.update(self.decode_copy.metrics())
        self.step += 1
        self._sampler_after_step = self.profile_sampler.state_dict()
    t2 = time.perf_counter()
    dialogues, stats = rolled.dialogues, rolled.stats
    # The first round's (the only one without dynamic sampling): rewards of its trained dialogues,
    # every termination's share.
    out = summarize_rollout(rolled.first.trained)
    out.update({k: v for k, v in summarize_rollout(rolled.first.dialogues).items()
                if k.startswith("termination/")})
    out["simulator/error_dialogues"] = float(sum(d.termination == SIMULATOR_ERROR for d in dialogues))
    out.update(rolled.metrics)
    out.update({f"simulator/http_{k}": float(v) for k, v in self.backend.take_counts().items()})
    out.update(metrics)
    out.update(extra)
    out.update(calls, **update_calls(batch.tokens.shape, batch.mini_batches, metrics["optimizer_updates"],
                                     scoring_passes=1 + (self.ref is not None) + (self.critic is not None)))
    out.update(rollout_seconds=t1 - t0, update_seconds=t2 - t1,
               rollout_fraction=(t1 - t0) / max(t2 - t0, 1e-9),
               rollout_policy_tokens_per_s=stats.policy_tokens / max(t1 - t0, 1e-9),
               policy_prefill_tokens=float(stats.policy_prefill_tokens),
               update_tokens_per_s=extra["sample_tokens"] * self.spec.rl.epochs / max(t2 - t1, 1e-9))
    if stats.simulator_prefill_tokens is not None:
      out["simulator_prefill_tokens"] = float(stats.simulator_prefill_tokens)
    if stats.simulator_cut_answers is not None:
      out["simulator/cut_answers"] = float(stats.simulator_cut_answers)
    return StepResult(out, dialogues)


def wandb_options(spec: RunSpec) -> WandbOptions | None:
  """config.log's W&B settings with the config as WORKDIR/config.json holds it; None when off."""
  log = spec.log
  if not log.wandb_project:
    return None
  return WandbOptions(log.wandb_project, log.wandb_entity, log.wandb_run_name,
                      json.loads(config_json(spec.source)))


def summarize_rollout(dialogues: list[Dialogue]) -> dict[str, float]:
  """A step's rollout metrics: rewards, final emotions, rates, turns, failures, termination shares."""
  rewards = np.array([d.reward for d in dialogues])
  s = summarize(dialogues)
  out = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
         "final_emotion_mean": s["score"], "success_rate": s["success_rate"],
         "failure_rate": s["failure_rate"], "positive_rate": s["positive_rate"],
         "turns_mean": s["mean_turns"], "parse_failures": float(s["parse_failures"]),
         "reply_failures": float(s["reply_failures"]), "silent_replies": float(s["silent_replies"]),
         "format_violation_rate": float(np.mean([not all(d.format_ok) for d in dialogues])),
         "unparsed_emotion_rate": _unparsed_rate(dialogues)}
  for reason, n in s["terminations"].items():
    out[f"termination/{reason}"] = n / len(dialogues)
  return out


def _unparsed_rate(dialogues: list[Dialogue]) -> float:
  """Share of emotion steps whose change line could not be read, even after the retries."""
  steps = [ok for d in dialogues for ok in d.parsed]
  return float(steps.count(False) / len(steps)) if steps else 0.0


_SIMULATOR_STREAM = 0x51A  # fold_in tag: the simulator's key, apart from the policy's
_EXTRA_ROUND_STREAM = 0xD5 << 8  # fold_in tags of dynamic sampling's extra rounds (+ round)


def reseed_simulator(backend, rng) -> None:
  """A sampling simulator draws from a key derived from `rng` (the step's key, restored on resume),
  not from a stream it advanced itself: resumed runs repeat it, and evaluations do not shift it."""
  backend.reseed(jax.random.fold_in(rng, _SIMULATOR_STREAM))


class TooManySimulatorErrors(SimulatorBackendError):
  """More than simulator.max_failed_share of a step's dialogues lost their simulator."""


def update_metrics(per_update: list[dict], weights: list[float]) -> dict[str, float]:
  """A step's update metrics from each optimizer update's (host values): per-token means weighted by
  the update's policy tokens, ratio extremes over all, grad norms averaged per update."""
  w = np.asarray(weights) if sum(weights) > 0 else np.ones(len(weights))
  out = {}
  for k in per_update[0]:
    v = [float(m[k]) for m in per_update]
    if k.endswith("ratio_max") or k.endswith("ratio_min"):
      out[k] = float(np.max(v) if k.endswith("max") else np.min(v))
    elif k.endswith("grad_norm"):  # one value per optimizer update, whatever its size
      out[k] = float(np.mean(v))
    else:
      out[k] = float(np.average(v, weights=w))
  out["optimizer_updates"] = float(len(per_update))
  return out
