"""Every training setting that is only used late in a run (at the first update, the first held-out
evaluation), checked before anything is loaded or written: a typo must not surface after an hour
of rollouts, nor leave a config.json behind that then refuses the corrected command."""
from __future__ import annotations

import math

from rlver_jax import build
from rlver_jax.env import rollout, simulator_prompts
from rlver_jax.rl import losses


def _sampling(section) -> list[tuple]:
  t, p, k = section.temperature, section.top_p, section.top_k
  return [("temperature", t, math.isfinite(t) and t >= 0, ">= 0 (0 = greedy)"),
          ("top_p", p, 0 < p <= 1, "in (0, 1]"),
          ("top_k", k, isinstance(k, int) and not isinstance(k, bool) and k >= 0,
           "an integer >= 0 (0 = off)")]


def check_training_config(config) -> None:
  """Raises build.ConfigError naming the first bad key."""
  build.check_algo(config)
  r, s, e, o = config.rl, config.simulator, config.eval, config.optim
  evaluating = e.every_steps > 0
  checks = [
      ("total_steps", config.total_steps, config.total_steps >= 0, ">= 0"),
      ("rl.profiles_per_step", r.profiles_per_step, r.profiles_per_step >= 1, ">= 1"),
      ("rl.group_size", r.group_size, r.group_size >= 1, ">= 1"),
      ("rl.epochs", r.epochs, r.epochs >= 1, ">= 1"),
      ("rl.mini_batches", r.mini_batches, r.mini_batches >= 1, ">= 1"),
      ("rl.micro_batch_size", r.micro_batch_size, r.micro_batch_size >= 1, ">= 1"),
      ("rl.loss_agg", r.loss_agg, r.loss_agg in losses.AGG_MODES, f"one of {losses.AGG_MODES}"),
      ("rl.kl_kind", r.kl_kind, r.kl_kind in losses.KL_KINDS, f"one of {losses.KL_KINDS}"),
      ("rl.dual_clip", r.dual_clip, r.dual_clip == 0 or r.dual_clip > 1, "0 (off) or > 1"),
      ("rl.tis_cap", r.tis_cap, r.tis_cap >= 0, ">= 0 (0 = off)"),
      ("rl.reward_mode", r.reward_mode, r.reward_mode in rollout.REWARD_MODES,
       f"one of {rollout.REWARD_MODES}"),
      ("rl.gamma", r.gamma, 0 <= r.gamma <= 1, "in [0, 1]"),
      # Each turn its own sample (think, thoughts dropped): a turn's sample earns the later turns'
      # reward undiscounted, which only equals the one-sequence return at gamma = 1.
      ("rl.gamma", r.gamma, r.gamma == 1 or config.algo != "ppo" or not config.policy.think
       or config.policy.keep_thoughts,
       "1 with policy.think=True and keep_thoughts=False (each turn is its own sample)"),
      ("rl.lam", r.lam, 0 <= r.lam <= 1, "in [0, 1]"),
      ("rl.clip_low", r.clip_low, 0 < r.clip_low < 1, "in (0, 1)"),
      ("rl.clip_high", r.clip_high, r.clip_high > 0, "> 0"),
      ("rl.value_clip", r.value_clip, r.value_clip >= 0, ">= 0 (0 = off)"),
      ("rl.entropy_coef", r.entropy_coef, r.entropy_coef >= 0, ">= 0"),
      ("rl.kl_coef", r.kl_coef, r.kl_coef >= 0, ">= 0"),
      ("rl.logits_chunk", r.logits_chunk, r.logits_chunk >= 1, ">= 1"),
      # A format penalty needs a format to check: only think mode asks for one.
      ("rl.format_penalty", r.format_penalty, not r.format_penalty or config.policy.think,
       "False unless policy.think=True (no-think replies have no format to penalise)"),
      ("optim.actor_lr", o.actor_lr, o.actor_lr > 0, "> 0"),
      ("optim.critic_lr", o.critic_lr, o.critic_lr > 0, "> 0"),
      ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
      ("optim.b1", o.b1, 0 <= o.b1 < 1, "in [0, 1)"),
      ("optim.b2", o.b2, 0 <= o.b2 < 1, "in [0, 1)"),
      ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
      ("optim.grad_clip", o.grad_clip, o.grad_clip >= 0, ">= 0 (0 = off)"),
      ("policy.language", config.policy.language,
       config.policy.language in ("",) + simulator_prompts.LANGUAGES,
       f"'' (each profile's own) or one of {simulator_prompts.LANGUAGES}"),
      ("simulator.style", s.style, s.style in simulator_prompts.STYLES,
       f"one of {simulator_prompts.STYLES}"),
      ("simulator.max_turns", s.max_turns, s.max_turns >= 1, ">= 1"),
      ("simulator.max_parse_retries", s.max_parse_retries, s.max_parse_retries >= 0, ">= 0"),
      ("simulator.start_emotion", s.start_emotion, 0 <= s.start_emotion <= 100, "in [0, 100]"),
      ("checkpoint.every_steps", config.checkpoint.every_steps, config.checkpoint.every_steps >= 0,
       ">= 0 (0 = at the end and on preemption only)"),
      ("checkpoint.keep", config.checkpoint.keep, config.checkpoint.keep >= 1, ">= 1"),
      ("eval.every_steps", e.every_steps, e.every_steps >= 0, ">= 0 (0 = never)"),
  ] + [(f"policy.{k}", *rest) for k, *rest in _sampling(config.policy)]
  if evaluating:
    checks += [
        ("data.num_holdout", config.data.num_holdout, config.data.num_holdout >= 1,
         ">= 1 when eval.every_steps > 0 (the evaluation runs on the held-out profiles)"),
        ("eval.num_profiles", e.num_profiles, 0 <= e.num_profiles <= config.data.num_holdout,
         f"in [0, data.num_holdout={config.data.num_holdout}] (0 = all held-out profiles)"),
        ("eval.max_turns", e.max_turns, e.max_turns >= 1, ">= 1"),
        ("eval.start_emotion", e.start_emotion, 0 <= e.start_emotion <= 100, "in [0, 100]"),
    ] + [(f"eval.{k}", *rest) for k, *rest in _sampling(e)]
  for key, value, ok, need in checks:
    if not ok:
      raise build.ConfigError(f"config.{key}={value!r}: must be {need}")
