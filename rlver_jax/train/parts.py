"""What a training run is made of, assembled in one place: the training mesh, each model in its
layout (policy and critic in config.mesh, the policy's decode copy in rollout.policy_mesh, the
simulator in simulator.mesh), the policy's sampler, the simulator backend and the updaters.
`Trainer` receives it; the run's state (parameters, optimizer states, the step) stays the Trainer's.
"""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from rlver_jax import build
from rlver_jax.models.qwen2 import Qwen2
from rlver_jax.models.tokenizer import ChatTokens
from rlver_jax.rl.update import Updater, make_optimizer
from rlver_jax.sampling.decode_copy import DecodeCopy
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.spec import RunSpec


@dataclasses.dataclass
class RunParts:
  mesh: jax.sharding.Mesh | None  # the training layout's
  layouts: dict[str, str]  # "train", "policy_rollout", "simulator" -> description (provenance.json)
  policy: Qwen2
  chat: ChatTokens
  policy_path: str  # the checkpoint directory it loaded from
  decode_copy: DecodeCopy  # the policy's weights in its rollout layout, refreshed after each update
  sampler: Sampler  # the policy's, in its rollout layout
  backend: object  # the simulated user's text generator (env.backends)
  policy_up: Updater
  critic: Qwen2 | None  # with its updater, only for an algorithm with a critic
  critic_up: Updater | None


def assemble(spec: RunSpec) -> RunParts:
  """Loads every model of the run into its layout over the training mesh's devices."""
  mesh = build.mesh_from(spec.mesh)
  with jax.set_mesh(mesh):
    policy, chat, policy_path = build.load_policy(spec.policy, mesh)
    layouts = {"train": build.train_layout(spec.mesh, mesh)}
    rollout_mesh, layouts["policy_rollout"] = build.decode_mesh(
        spec.rollout.policy_mesh, "rollout.policy_mesh", policy.config, spec.mesh, mesh,
        policy.dtype, "policy rollout")
    decode_copy = DecodeCopy(nnx.state(policy, nnx.Param), rollout_mesh, policy.dtype)
    sampler = build.policy_sampler(policy, chat, spec.policy, rollout_mesh)
    sim_mesh, layouts["simulator"] = build.simulator_mesh(spec.simulator, spec.mesh, mesh)
    backend = build.simulator_backend(spec.simulator, sim_mesh, seed=spec.seed,
                                      share_prefix=spec.rl.share_prefix, rows=spec.rollout.rows)
    loss_cfg = spec.loss_config()
    policy_up = Updater(policy, make_optimizer(spec.optim.optim_config()), "policy", loss_cfg)
    critic = critic_up = None
    if spec.algorithm.has_critic:
      critic = build.load_critic(spec.critic, spec.policy, mesh, policy_path, seed=spec.seed)
      critic_up = Updater(critic, make_optimizer(spec.optim.optim_config(critic=True)), "value",
                          loss_cfg)
  return RunParts(mesh=mesh, layouts=layouts, policy=policy, chat=chat, policy_path=policy_path,
                  decode_copy=decode_copy, sampler=sampler, backend=backend, policy_up=policy_up,
                  critic=critic, critic_up=critic_up)
