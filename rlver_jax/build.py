"""From a run spec to live components: mesh, models, samplers, simulator backend, and `assemble`,
the one path that puts a run's parts together (training and the Sentient evaluation).

The settings come as the typed sections of `rlver_jax.spec` (checked there, before anything loads);
what can only be checked against a loaded file (a checkpoint's trained context length, a profile
file that exists) is checked here, with the same `config.KEY` messages.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
from absl import logging
from etils import epath
from flax import nnx

from rlver_jax.env import backends as sim_backends
from rlver_jax.env.model_backend import ModelBackend
from rlver_jax.env.profiles import DEMO_PROFILE_SETS, Profile, load_profiles
from rlver_jax.models import load_pretrained
from rlver_jax.models.io import hub
from rlver_jax.models.io.hf import read_config
from rlver_jax.models.presets import Qwen2Config, param_dtype_of
from rlver_jax.models.qwen2 import Qwen2
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.parallel.sharding import MeshConfig, make_mesh
from rlver_jax.rl.update import Updater, make_optimizer
from rlver_jax.sampling.decode_copy import DecodeCopy
from rlver_jax.sampling.drafted import DraftedSampler
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.speculative import SpeculativeSampler
from rlver_jax.sampling.strategies import SamplingParams
from rlver_jax.spec import (ConfigError, CriticSpec, EvaluationSpec, PolicySpec, RunSpec,
                            SimulatorSpec)
from rlver_jax.spec import layouts
from rlver_jax.spec.layouts import describe

# ConfigError is imported from the spec for the callers that raise or catch build.ConfigError.


def mesh_from(mesh: MeshConfig) -> jax.sharding.Mesh:
  try:
    return make_mesh(mesh)
  except ValueError as e:
    raise ConfigError(f"config.mesh: {e}") from e


def _hbm_bytes() -> int | None:
  """One device's memory (None where the backend does not say: CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def train_layout(train: MeshConfig, mesh: jax.sharding.Mesh) -> str:
  """The training layout's description (config.mesh resolved), logged like the decode layouts."""
  text = describe(MeshConfig(*train.resolve(mesh.size)))
  logging.debug("training layout: %s", text)  # in provenance.json; on the console with -v
  return text


def decode_mesh(value: str, key: str, model: Qwen2Config, train: MeshConfig,
                train_mesh: jax.sharding.Mesh | None, dtype, role: str, *,
                int8_weights: bool = False) -> tuple[jax.sharding.Mesh | None, str]:
  """(mesh, description) of the layout a decoding model gets from its setting `value` at config
  `key`, over the training mesh's devices: `spec.layouts.decode_mesh`, the resolver the AOT model
  calls too (weights counted as stored in `dtype`, int8 with their scales). Logs one line naming
  it (at --verbosity=1; the trainer writes every layout to provenance.json). Without a training
  mesh (one device, no mesh) there is nothing to lay out."""
  if train_mesh is None:
    return None, "no mesh"
  weights = layouts.weight_bytes(model, dtype, int8_weights=int8_weights)
  mesh = layouts.decode_mesh(value, key, model, train, train_mesh, weight_bytes=weights,
                             hbm_bytes=_hbm_bytes())
  text = f"{describe(layouts.mesh_sizes(mesh))} ({value})"
  logging.debug("%s layout: %s", role, text)
  return mesh, text


def checkpoint_dir(path: str) -> str:
  """The directory a checkpoint setting names: 'embedded' is the converted embedded model."""
  if path == "embedded":
    from rlver_jax.models.embedded import embedded_model_dir
    return embedded_model_dir()
  return path


def resolve_checkpoint(path: str, key: str) -> str:
  """The local or gs:// directory of a checkpoint setting, which must hold an HF checkpoint:
  'embedded' is the converted embedded model, a Hub id (`ORG/NAME[@REV]`, `models.io.hub`) its
  snapshot in the Hugging Face cache, downloaded if need be. `key` names the setting in errors:
  a config key ("policy.checkpoint") or a flag ("--checkpoint")."""
  setting = key if key.startswith("--") else f"config.{key}"
  if path == "embedded":
    return checkpoint_dir(path)
  if not path:
    raise ConfigError(f"{setting} is empty: give an HF safetensors directory, a Hub id or 'embedded'")
  if hub.is_hub_id(path):
    path = hub.resolve(path, setting)
  if not path.startswith("gs://") and not os.path.isdir(path):
    raise ConfigError(f"{setting}: checkpoint directory {path} does not exist")
  if not epath.Path(path).joinpath("config.json").exists():
    raise ConfigError(f"{setting}: {path} has no config.json (not an HF checkpoint directory)")
  return path


def input_paths(spec: RunSpec | EvaluationSpec) -> dict[str, str]:
  """The files and directories a run reads, by config key ('embedded' checkpoints and shipped demo
  profiles left out: they ship in packages every host has; Hub ids too: each host resolves them
  from its own cache). Only training reads a critic."""
  paths = {"data.profiles": spec.data.profiles, **spec.checkpoints}
  return {k: v for k, v in paths.items()
          if v and v not in ("embedded", *DEMO_PROFILE_SETS) and not hub.is_hub_id(v)}


def profiles_from(path: str) -> list[Profile]:
  if path in DEMO_PROFILE_SETS:
    return load_profiles(DEMO_PROFILE_SETS[path])
  if not path.startswith("gs://") and not os.path.exists(path):
    raise ConfigError(f"config.data.profiles: profile file {path} does not exist")
  return load_profiles(path)


def policy_config(policy: PolicySpec) -> Qwen2Config:
  """The policy checkpoint's model config (its config.json), without loading weights."""
  return read_config(resolve_checkpoint(policy.checkpoint, "policy.checkpoint"))


def load_policy(policy: PolicySpec, mesh):
  """(model, chat tokens, checkpoint dir) for the policy: fp32 master params, compute dtype separate."""
  path = resolve_checkpoint(policy.checkpoint, "policy.checkpoint")
  model, _ = load_pretrained(path, dtype=param_dtype_of(policy.compute_dtype), mesh=mesh,
                             param_dtype=param_dtype_of(policy.param_dtype), remat=policy.remat)
  return model, ChatTokens(load_tokenizer(path)), path


def load_critic(critic: CriticSpec, policy: PolicySpec, mesh, policy_path: str, seed: int = 0):
  """The value model: config.critic.checkpoint, or the policy's checkpoint, with a new value head
  (config.critic.head_init; Hugging Face checkpoints hold none)."""
  path = (resolve_checkpoint(critic.checkpoint, "critic.checkpoint") if critic.checkpoint
          else policy_path)
  model, config = load_pretrained(path, dtype=param_dtype_of(policy.compute_dtype), mesh=mesh,
                                  param_dtype=param_dtype_of(policy.param_dtype), head="value",
                                  remat=policy.remat)
  if critic.head_init == "normal":
    init_value_head(model, jax.random.key(seed), config.initializer_range)
  return model


def init_value_head(model, key: jax.Array, std: float) -> None:
  """N(0, std) value-head weights and a zero bias, as a new Linear layer starts in transformers
  (the reference's critic); in place, in the head's own sharding and dtype."""
  head = model.value_head[...]
  weights = std * jax.random.normal(key, head.shape, jnp.float32)
  model.value_head[...] = jax.device_put(weights.astype(head.dtype), head.sharding)


def check_context(trained: int, max_context: int, setting: str) -> None:
  """Positions past the checkpoint's trained length are out of distribution (no RoPE scaling here).
  `setting` names where the length came from ("config.policy.max_context", "--max_len")."""
  if max_context > trained:
    raise ConfigError(f"{setting}={max_context} exceeds the checkpoint's max_position_embeddings "
                      f"({trained}); lower it to at most {trained}")


def policy_sampler(model, chat: ChatTokens, policy: PolicySpec, mesh) -> Sampler:
  check_context(model.config.max_position_embeddings, policy.max_context,
                "config.policy.max_context")
  return Sampler(model, max_len=policy.max_context, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                 append_buckets=policy.append_buckets, mesh=mesh,
                 decode_segment=policy.decode_segment, window_step=policy.window_step)


def simulator_config(sim: SimulatorSpec) -> Qwen2Config:
  """The co-located simulator's model config (its checkpoint's config.json), its context checked."""
  hf_config = read_config(resolve_checkpoint(sim.checkpoint, "simulator.checkpoint"))
  check_context(hf_config.max_position_embeddings, sim.max_context, "config.simulator.max_context")
  return hf_config


def simulator_mesh(sim: SimulatorSpec, train: MeshConfig, train_mesh) -> tuple[object, str]:
  """(mesh, description) of the simulator's decode layout (config.simulator.mesh); a backend
  without a model has none."""
  if sim.backend != "model":
    return None, "no model"
  # Its layout's memory check counts the weights as stored: int8 weights take a byte each.
  return decode_mesh(sim.mesh, "simulator.mesh", simulator_config(sim), train, train_mesh,
                     param_dtype_of(sim.dtype), "simulator", int8_weights=sim.weight_dtype == "int8")


def checked_draft(draft: str, *, key: str, target: str, target_key: str,
                  target_config: Qwen2Config, max_context: int, context_key: str,
                  role: str) -> Qwen2Config:
  """The config of a draft checkpoint (`draft` at config `key`) for the `role` model `target` (at
  `target_key`), checked against it: the same tokenizer (the verify rule compares their
  distributions token by token), at most its embedding rows (Qwen2.5's small models pad to fewer
  than its large ones), and room for `max_context` (config `context_key`)."""
  label, target_label = f"config.{key}={draft!r}", f"config.{target_key}={target!r}"
  path = resolve_checkpoint(draft, key)
  config = read_config(path)
  vocab = load_tokenizer(path).get_vocab()
  target_vocab = load_tokenizer(resolve_checkpoint(target, target_key)).get_vocab()
  if vocab != target_vocab:
    raise ConfigError(f"{label} has another tokenizer ({len(vocab)} tokens) than {target_label} "
                      f"({len(target_vocab)}): a draft needs the {role}'s vocabulary")
  if not len(vocab) <= config.vocab_size <= target_config.vocab_size:
    raise ConfigError(f"{label} has {config.vocab_size} vocabulary rows, {target_label} "
                      f"{target_config.vocab_size}: a draft needs at most the {role}'s")
  check_context(config.max_position_embeddings, max_context,
                f"config.{context_key} (the draft {draft!r})")
  return config


def draft_config(sim: SimulatorSpec) -> Qwen2Config:
  """The simulator's draft model config (config.simulator.draft_checkpoint), checked against the
  simulator's (`checked_draft`)."""
  return checked_draft(sim.draft_checkpoint, key="simulator.draft_checkpoint",
                       target=sim.checkpoint, target_key="simulator.checkpoint",
                       target_config=simulator_config(sim), max_context=sim.max_context,
                       context_key="simulator.max_context", role="simulator")


def draft_mesh(sim: SimulatorSpec, train: MeshConfig, train_mesh) -> tuple[object, str]:
  """(mesh, description) of the draft's decode layout (config.simulator.draft_mesh: 'auto' is the
  resolver's choice for the draft model); (None, 'no draft') without one."""
  if sim.backend != "model" or not sim.draft_checkpoint:
    return None, "no draft"
  return decode_mesh(sim.draft_mesh, "simulator.draft_mesh", draft_config(sim), train, train_mesh,
                     param_dtype_of(sim.dtype), "simulator draft")


def _draft_sampler(checkpoint: str, key: str, mesh, chat: ChatTokens, *, dtype, param_dtype=None,
                   max_len: int, append_buckets, window_step: int) -> tuple[Sampler, object]:
  """(a draft's sampler, its params): the checkpoint at config `key`, already checked
  (`checked_draft`), loaded in `mesh`, with its target's cache shapes; stop ids and padding are the
  target's `chat` (the speculative decode applies the target's)."""
  path = resolve_checkpoint(checkpoint, key)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    model, _ = load_pretrained(path, dtype=dtype, mesh=mesh, param_dtype=param_dtype)
  sampler = Sampler(model, max_len=max_len, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                    append_buckets=append_buckets, mesh=mesh, window_step=window_step)
  return sampler, nnx.state(model, nnx.Param)


def drafted_policy(spec: EvaluationSpec, sampler: Sampler, chat: ChatTokens,
                   train_mesh) -> tuple[DraftedSampler, str]:
  """The evaluated policy's `sampler` decoding with config.rollout.policy_draft_checkpoint, loaded
  in rollout.policy_draft_mesh and the policy's dtypes; and the draft's layout, described."""
  r, policy = spec.rollout, spec.policy
  config = checked_draft(r.policy_draft_checkpoint, key="rollout.policy_draft_checkpoint",
                         target=policy.checkpoint, target_key="policy.checkpoint",
                         target_config=sampler.config, max_context=policy.max_context,
                         context_key="policy.max_context", role="policy")
  mesh, text = decode_mesh(r.policy_draft_mesh, "rollout.policy_draft_mesh", config, spec.mesh,
                           train_mesh, param_dtype_of(policy.param_dtype), "policy draft")
  draft, params = _draft_sampler(
      r.policy_draft_checkpoint, "rollout.policy_draft_checkpoint", mesh, chat,
      dtype=param_dtype_of(policy.compute_dtype), param_dtype=param_dtype_of(policy.param_dtype),
      max_len=policy.max_context, append_buckets=policy.append_buckets,
      window_step=policy.window_step)
  return DraftedSampler(SpeculativeSampler(sampler, draft, r.policy_draft_tokens), params), text


def simulator_backend(sim: SimulatorSpec, mesh, *, seed: int, share_prefix: bool = True,
                      rows: int = 0, draft_mesh=None):
  """The simulated user's text generator named by config.simulator.backend (its own frozen weights
  on `mesh`, its decode layout: `simulator_mesh`; a model backend samples from `seed`, on at most
  `rows` cache rows: config.rollout.rows). A draft (simulator.draft_checkpoint) loads into
  `draft_mesh` (`draft_mesh` above)."""
  if sim.backend == "scripted":
    return sim_backends.ScriptedBackend()
  if sim.backend == "http":
    return sim_backends.OpenAIChatBackend(
        sim.http_base_url, sim.http_model, api_key_env=sim.http_api_key_env,
        temperature=sim.temperature, top_p=sim.top_p, max_tokens=sim.max_new_tokens,
        timeout_s=sim.http_timeout_s, deadline_s=sim.http_deadline_s,
        max_attempts=sim.http_max_attempts, max_concurrency=sim.http_max_concurrency)
  path = resolve_checkpoint(sim.checkpoint, "simulator.checkpoint")
  simulator_config(sim)  # checked, and its draft's, before any weights load
  if sim.draft_checkpoint:
    draft_config(sim)
  # Born sharded on its own mesh, where it stays: loading and decoding run under it.
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    model, _ = load_pretrained(path, dtype=param_dtype_of(sim.dtype), mesh=mesh,
                               int8_weights=sim.weight_dtype == "int8")
  chat = ChatTokens(load_tokenizer(path))
  sampler = Sampler(model, max_len=sim.max_context, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                    append_buckets=sim.append_buckets, mesh=mesh,
                    decode_segment=sim.decode_segment, window_step=sim.window_step,
                    cache_dtype=jnp.int8 if sim.kv_dtype == "int8" else None)
  draft, draft_params = None, None
  if sim.draft_checkpoint:
    draft, draft_params = _draft_sampler(
        sim.draft_checkpoint, "simulator.draft_checkpoint", draft_mesh, chat,
        dtype=param_dtype_of(sim.dtype), max_len=sim.max_context,
        append_buckets=sim.append_buckets, window_step=sim.window_step)
  return ModelBackend(sampler, nnx.state(model), chat, max_new_tokens=sim.max_new_tokens,
                      sampling=SamplingParams.make(sim.temperature, sim.top_p, sim.top_k),
                      seed=seed + 1, share_prefix=share_prefix, stop_at_lines=sim.stop_at_lines,
                      rows=rows, draft=draft, draft_params=draft_params,
                      draft_tokens=sim.draft_tokens)


@dataclasses.dataclass
class RunParts:
  """What a run is made of: the meshes, each model in its layout, the policy's sampler and the
  simulator backend; for training also the policy's decode copy, the critic and the updaters (the
  run's state, parameters and optimizer states, stays the Trainer's)."""
  mesh: jax.sharding.Mesh | None  # the training layout's
  # "train", "policy_rollout", "simulator" (and "simulator_draft", an evaluation's "policy_draft")
  # -> description (provenance.json)
  layouts: dict[str, str]
  policy: Qwen2
  chat: ChatTokens
  policy_path: str  # the checkpoint directory it loaded from
  sampler: Sampler | DraftedSampler  # the policy's, in its rollout layout (an evaluation's: drafted)
  backend: object  # the simulated user's text generator (env.backends)
  decode_copy: DecodeCopy | None = None  # training: the policy in its rollout layout, refreshed
  policy_up: Updater | None = None       # training
  critic: Qwen2 | None = None            # training with a critic, and its updater
  critic_up: Updater | None = None


def assemble(spec: RunSpec | EvaluationSpec) -> RunParts:
  """Loads every model of a run into its layout over the training mesh's devices. Training
  (RunSpec): the policy and critic in config.mesh, the policy's decode copy in rollout.policy_mesh,
  the updaters. An evaluation: nothing trains, so the policy loads straight into its decode layout."""
  mesh = mesh_from(spec.mesh)
  layouts = {"train": train_layout(spec.mesh, mesh)}
  training = isinstance(spec, RunSpec)
  with jax.set_mesh(mesh) if training else contextlib.nullcontext():
    if training:
      policy, chat, path = load_policy(spec.policy, mesh)
      rollout_mesh, layouts["policy_rollout"] = decode_mesh(
          spec.rollout.policy_mesh, "rollout.policy_mesh", policy.config, spec.mesh, mesh,
          policy.dtype, "policy rollout")
      decode_copy = DecodeCopy(nnx.state(policy, nnx.Param), rollout_mesh, policy.dtype)
    else:
      rollout_mesh, layouts["policy_rollout"] = decode_mesh(
          spec.rollout.policy_mesh, "rollout.policy_mesh", policy_config(spec.policy), spec.mesh,
          mesh, param_dtype_of(spec.policy.param_dtype), "policy rollout")
      with jax.set_mesh(rollout_mesh):
        policy, chat, path = load_policy(spec.policy, rollout_mesh)
      decode_copy = None
    sampler = policy_sampler(policy, chat, spec.policy, rollout_mesh)
    sim_mesh, layouts["simulator"] = simulator_mesh(spec.simulator, spec.mesh, mesh)
    sim_draft_mesh, draft_layout = draft_mesh(spec.simulator, spec.mesh, mesh)
    if spec.simulator.draft_checkpoint:
      layouts["simulator_draft"] = draft_layout
    if not training:
      if spec.rollout.policy_draft_checkpoint:
        sampler, layouts["policy_draft"] = drafted_policy(spec, sampler, chat, mesh)
      backend = simulator_backend(spec.simulator, sim_mesh, seed=spec.seed,
                                  draft_mesh=sim_draft_mesh)
      return RunParts(mesh=mesh, layouts=layouts, policy=policy, chat=chat, policy_path=path,
                      sampler=sampler, backend=backend)
    backend = simulator_backend(spec.simulator, sim_mesh, seed=spec.seed,
                                share_prefix=spec.rl.share_prefix, rows=spec.rollout.rows,
                                draft_mesh=sim_draft_mesh)
    loss_cfg = spec.loss_config()
    policy_up = Updater(policy, make_optimizer(spec.optim.optim_config()), "policy", loss_cfg)
    critic = critic_up = None
    if spec.algorithm.has_critic:
      critic = load_critic(spec.critic, spec.policy, mesh, path, seed=spec.seed)
      critic_up = Updater(critic, make_optimizer(spec.optim.optim_config(critic=True)), "value",
                          loss_cfg)
  return RunParts(mesh=mesh, layouts=layouts, policy=policy, chat=chat, policy_path=path,
                  sampler=sampler, backend=backend, decode_copy=decode_copy, policy_up=policy_up,
                  critic=critic, critic_up=critic_up)
