"""From a run's ConfigDict to typed settings and live components (mesh, models, samplers, simulator).

This is the one place that reads the ConfigDict for training and evaluation; everything below it
sees frozen dataclasses or plain arguments.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_collections
from etils import epath
from flax import nnx

from rlver_jax.env import backends as sim_backends
from rlver_jax.env.model_backend import ModelBackend
from rlver_jax.env.profiles import Profile, load_demo_profiles, load_profiles
from rlver_jax.env.rollout import RolloutConfig
from rlver_jax.models import load_pretrained
from rlver_jax.models.presets import from_hf_config, param_dtype_of
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.rl.update import LossConfig, OptimConfig
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams
from rlver_jax.sharding import MeshConfig, make_mesh


class ConfigError(ValueError):
  """A config value that cannot work; the message names the key."""


def mesh_from(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  m = config.mesh
  try:
    return make_mesh(MeshConfig(data=m.data, fsdp=m.fsdp, tensor=m.tensor))
  except ValueError as e:
    raise ConfigError(f"config.mesh: {e}") from e


def checkpoint_dir(path: str) -> str:
  """The directory a checkpoint setting names: 'embedded' is the converted embedded model."""
  if path == "embedded":
    from rlver_jax.models.embedded import embedded_model_dir
    return embedded_model_dir()
  return path


def resolve_checkpoint(path: str, key: str) -> str:
  """'embedded' -> the converted embedded model; otherwise the path, which must exist."""
  if path == "embedded":
    return checkpoint_dir(path)
  if not path:
    raise ConfigError(f"config.{key} is empty: give an HF safetensors directory or 'embedded'")
  if not path.startswith("gs://") and not os.path.isdir(path):
    raise ConfigError(f"config.{key}: checkpoint directory {path} does not exist")
  if not epath.Path(path).joinpath("config.json").exists():
    raise ConfigError(f"config.{key}: {path} has no config.json (not an HF checkpoint directory)")
  return path


def input_paths(config, *, training: bool = True) -> dict[str, str]:
  """The files and directories a run reads, by config key ('embedded' checkpoints and 'demo'
  profiles left out: they ship in packages every host has)."""
  paths = {"data.profiles": config.data.profiles, "policy.checkpoint": config.policy.checkpoint}
  if training and config.algo == "ppo":
    paths["critic.checkpoint"] = config.critic.checkpoint
  if config.simulator.backend == "model":
    paths["simulator.checkpoint"] = config.simulator.checkpoint
  return {k: v for k, v in paths.items() if v and v not in ("embedded", "demo")}


def profiles_from(path: str) -> list[Profile]:
  if path == "demo":
    return load_demo_profiles()
  if not path.startswith("gs://") and not os.path.exists(path):
    raise ConfigError(f"config.data.profiles: profile file {path} does not exist")
  return load_profiles(path)


def rollout_config(config, *, eval_mode: bool = False) -> RolloutConfig:
  p = config.policy
  return RolloutConfig(think=p.think, keep_thoughts=p.keep_thoughts, max_new_tokens=p.max_new_tokens,
                       temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                       reward_mode="terminal" if eval_mode else config.rl.reward_mode,
                       format_penalty=False if eval_mode else config.rl.format_penalty,
                       language=p.language or None)


def check_algo(config) -> None:
  """Rejects settings the chosen algorithm would silently ignore (before any model is loaded)."""
  r = config.rl
  if config.algo not in ("grpo", "ppo"):
    raise ConfigError(f"config.algo: unknown algorithm {config.algo!r} (expected grpo or ppo)")
  if config.algo == "grpo":
    # GRPO normalises one scalar per dialogue within its group; token-level rewards have no place.
    if r.reward_mode != "terminal":
      raise ConfigError(f"config.rl.reward_mode={r.reward_mode!r} needs algo=ppo: GRPO uses one "
                        "reward per dialogue (use 'terminal')")
    if r.kl_in_reward and r.kl_coef > 0:
      raise ConfigError("config.rl.kl_in_reward=True needs algo=ppo: GRPO takes its KL as a loss "
                        "term (set kl_in_reward=False)")
    if r.group_size < 2:
      raise ConfigError(f"config.rl.group_size={r.group_size}: GRPO needs >= 2 dialogues per profile "
                        "(a group of one has zero advantage, so nothing is learned)")
  p = config.policy
  if (p.temperature != 1.0 or p.top_p != 1.0 or p.top_k != 0) and not r.tis_cap:
    # The trainer's ratios use the model's own (T=1, untruncated) log-probs; samples drawn from a
    # reshaped distribution are off-policy unless truncated importance sampling corrects them.
    raise ConfigError(f"config.policy sampling (temperature={p.temperature}, top_p={p.top_p}, "
                      f"top_k={p.top_k}) differs from the distribution being trained: use 1.0 / 1.0 / "
                      "0, or set config.rl.tis_cap (e.g. 2.0) to correct for it")
  if r.loss_norm_len < 0:
    raise ConfigError(f"config.rl.loss_norm_len={r.loss_norm_len}: must be >= 0 (0 = policy.max_context)")


def holdout_rollout_config(config) -> RolloutConfig:
  """The held-out evaluation during training: eval sampling (config.eval), terminal rewards."""
  e = config.eval
  return dataclasses.replace(rollout_config(config, eval_mode=True), temperature=e.temperature,
                             top_p=e.top_p, top_k=e.top_k)


def loss_config(config) -> LossConfig:
  r = config.rl
  # Dr.GRPO's divisor is a constant of the run, not the packed length of each step's batch.
  norm_len = r.loss_norm_len or config.policy.max_context
  return LossConfig(clip_low=r.clip_low, clip_high=r.clip_high, dual_clip=r.dual_clip or None,
                    agg=r.loss_agg, norm_len=norm_len, entropy_coef=r.entropy_coef,
                    kl_coef=0.0 if r.kl_in_reward else r.kl_coef, kl_kind=r.kl_kind,
                    tis_cap=r.tis_cap or None, value_clip=r.value_clip or None,
                    logits_chunk=r.logits_chunk)


def optim_config(config, critic: bool = False) -> OptimConfig:
  o = config.optim
  return OptimConfig(learning_rate=o.critic_lr if critic else o.actor_lr, warmup_steps=o.warmup_steps,
                     b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, grad_clip=o.grad_clip)


def load_policy(config, mesh):
  """(model, chat tokens, checkpoint dir) for the policy: fp32 master params, compute dtype separate."""
  path = resolve_checkpoint(config.policy.checkpoint, "policy.checkpoint")
  model, _ = load_pretrained(path, dtype=param_dtype_of(config.policy.compute_dtype), mesh=mesh,
                             param_dtype=param_dtype_of(config.policy.param_dtype),
                             remat=config.policy.remat)
  return model, ChatTokens(load_tokenizer(path)), path


def load_critic(config, mesh, policy_path: str):
  path = (resolve_checkpoint(config.critic.checkpoint, "critic.checkpoint")
          if config.critic.checkpoint else policy_path)
  model, _ = load_pretrained(path, dtype=param_dtype_of(config.policy.compute_dtype), mesh=mesh,
                             param_dtype=param_dtype_of(config.policy.param_dtype), head="value",
                             remat=config.policy.remat)
  return model


def append_buckets(config, role: str) -> tuple[int, ...]:
  """config.<role>.append_buckets, checked: strictly ascending positive token counts."""
  buckets = tuple(config[role].append_buckets)
  ok = (buckets and all(isinstance(b, int) and b > 0 for b in buckets)
        and list(buckets) == sorted(set(buckets)))
  if not ok:
    raise ConfigError(f"config.{role}.append_buckets={buckets!r}: must be strictly ascending positive "
                      "token counts, e.g. (16, 64, 256, 1024)")
  return buckets


def check_context(trained: int, max_context: int, setting: str) -> None:
  """Positions past the checkpoint's trained length are out of distribution (no RoPE scaling here).
  `setting` names where the length came from ("config.policy.max_context", "--max_len")."""
  if max_context > trained:
    raise ConfigError(f"{setting}={max_context} exceeds the checkpoint's max_position_embeddings "
                      f"({trained}); lower it to at most {trained}")


def policy_sampler(model, chat: ChatTokens, config, mesh) -> Sampler:
  check_context(model.config.max_position_embeddings, config.policy.max_context,
                "config.policy.max_context")
  return Sampler(model, max_len=config.policy.max_context, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                 append_buckets=append_buckets(config, "policy"), mesh=mesh)


def simulator_backend(config, mesh):
  """The simulated user's text generator named by config.simulator.backend (its own frozen weights)."""
  s = config.simulator
  if s.backend == "scripted":
    return sim_backends.ScriptedBackend()
  if s.backend == "http":
    if not s.http_base_url or not s.http_model:
      raise ConfigError("config.simulator.http_base_url and config.simulator.http_model are required "
                        "for the http simulator backend")
    if s.top_k != 0:  # OpenAI-style chat APIs take temperature and top_p only
      raise ConfigError(f"config.simulator.top_k={s.top_k}: must be 0 with simulator.backend='http' "
                        "(the chat API has no top_k)")
    return sim_backends.OpenAIChatBackend(
        s.http_base_url, s.http_model, api_key_env=s.http_api_key_env, temperature=s.temperature,
        top_p=s.top_p, max_tokens=s.max_new_tokens, timeout_s=s.http_timeout_s,
        max_attempts=s.http_max_attempts, max_concurrency=s.http_max_concurrency)
  if s.backend != "model":
    raise ConfigError(f"config.simulator.backend: unknown backend {s.backend!r} "
                      "(expected 'model', 'http' or 'scripted')")
  path = resolve_checkpoint(s.checkpoint, "simulator.checkpoint")
  config_json = epath.Path(path).joinpath("config.json")
  hf_config = from_hf_config(json.loads(config_json.read_text()), str(config_json))
  check_context(hf_config.max_position_embeddings, s.max_context,  # before the weights load
                "config.simulator.max_context")
  model, _ = load_pretrained(path, dtype=param_dtype_of(s.dtype), mesh=mesh)
  chat = ChatTokens(load_tokenizer(path))
  sampler = Sampler(model, max_len=s.max_context, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                    append_buckets=append_buckets(config, "simulator"), mesh=mesh)
  return ModelBackend(sampler, nnx.state(model), chat, max_new_tokens=s.max_new_tokens,
                      sampling=SamplingParams.make(s.temperature, s.top_p, s.top_k), seed=config.seed + 1)
