"""The meshes a run's programs compile on: training (update, scoring passes) on `mesh`, the
policy's rollout on `rollout.policy_mesh`, the simulator on `simulator.mesh`, all over the same
devices (`rlver_jax.spec.layouts` resolves each setting; 'auto' adds FSDP only where a model's
weight shard would crowd the chip's HBM, so it is given the weights' bytes and the HBM here).

A policy in a serving layout decodes from a copy of its weights in the compute dtype, refreshed once
per step from the training params (`programs.reshard_program`); with 'train' it decodes from the
training params themselves (the behaviour before layouts: no copy, no reshard). A simulator's draft
(`aot.draft`) decodes on `simulator.draft_mesh`, resolved for the draft's own model.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
from jax.sharding import Mesh

from rlver_jax.aot import programs as ap
from rlver_jax.aot.target import Target
from rlver_jax.spec.forward import ModelShape
from rlver_jax.models.presets import param_dtype_of
from rlver_jax.parallel.sharding import MeshConfig, make_mesh
from rlver_jax.spec import RunSpec
from rlver_jax.spec import layouts as spec_layouts


def _shape(mesh: Mesh) -> str:
  return "x".join(str(mesh.shape[a]) for a in ("data", "fsdp", "tensor"))


@dataclasses.dataclass(frozen=True)
class Layouts:
  """The three meshes of a run over one set of devices; `policy_copy`: the policy decodes from a
  compute-dtype copy in its own layout (resident, refreshed by the reshard)."""
  train: Mesh
  policy: Mesh
  simulator: Mesh
  policy_copy: bool = False
  draft: Mesh | None = None              # the simulator's draft, when there is one
  draft_model: ModelShape | None = None

  def for_role(self, role: str) -> Mesh:
    if role == "simulator_draft":
      if self.draft is None:
        raise ValueError("no simulator draft in these layouts")
      return self.draft
    return {"policy": self.policy, "simulator": self.simulator}.get(role, self.train)

  def for_program(self, name: str) -> Mesh:
    """The mesh a registered program compiles on: its role's for sampler programs, else training."""
    return self.for_role(name.partition("_")[0])

  def describe(self) -> str:
    """'train 1x32x1, policy decode 8x1x4 (bf16 copy), simulator decode 4x1x8' (data x fsdp x tensor)."""
    copy = " (decode copy)" if self.policy_copy else ""
    draft = f", draft decode {_shape(self.draft)}" if self.draft is not None else ""
    return (f"train {_shape(self.train)}, policy decode {_shape(self.policy)}{copy}, "
            f"simulator decode {_shape(self.simulator)}{draft} (data x fsdp x tensor)")

  def shape(self, role: str) -> str:
    return _shape(self.for_role(role))


def single(mesh: Mesh) -> Layouts:
  """Every program on one mesh (an aot config's programs)."""
  return Layouts(mesh, mesh, mesh)


def weight_bytes(model: ModelShape) -> int:
  """Bytes of a decoding model's weights as stored, every shard together (`spec.layouts`)."""
  return spec_layouts.weight_bytes(ap.model_config(model), param_dtype_of(model.param_dtype),
                                   int8_weights=model.weight_dtype == "int8")


def resolve(spec: RunSpec, devices: Sequence[jax.Device], train: MeshConfig,
            hbm_bytes: int | None, draft: ModelShape | None = None) -> Layouts:
  """The run's layouts on `devices` with training mesh `train`: each decoding model's mesh from
  `spec.layouts.decode_mesh`, as the trainer resolves it (`build.decode_mesh`); ValueError
  (naming the key) for a decode layout that does not divide the devices or the model's heads.
  `draft`: the simulator's draft model, on `simulator.draft_mesh`."""
  train_mesh = make_mesh(train, devices)
  meshes = {}
  for role, key, value, model in (
      ("policy", "rollout.policy_mesh", spec.rollout.policy_mesh, ap.policy_decode_model(spec)),
      ("simulator", "simulator.mesh", spec.simulator.mesh, ap.simulator_model(spec))):
    if value == spec_layouts.TRAIN:
      meshes[role] = train_mesh
      continue
    meshes[role] = spec_layouts.decode_mesh(value, key, ap.model_config(model), train, train_mesh,
                                            weight_bytes=weight_bytes(model), hbm_bytes=hbm_bytes)
  draft_mesh = None
  if draft is not None:
    draft_mesh = spec_layouts.decode_mesh(
        spec.simulator.draft_mesh, "simulator.draft_mesh", ap.model_config(draft), train,
        train_mesh, weight_bytes=weight_bytes(draft), hbm_bytes=hbm_bytes)
  return Layouts(train_mesh, meshes["policy"], meshes["simulator"],
                 policy_copy=spec.rollout.policy_mesh != spec_layouts.TRAIN, draft=draft_mesh,
                 draft_model=draft)


RESHARD = "policy_reshard"


def build(name: str, target: Target, layouts: Layouts):
  """(jitted_fn, abstract_args) of a registered program (`programs.PROGRAMS`) or the reshard, on
  its layout's mesh."""
  if name == RESHARD:
    return ap.reshard_program(target, layouts.train, layouts.policy)
  return ap.PROGRAMS[name](target, layouts.for_program(name))
