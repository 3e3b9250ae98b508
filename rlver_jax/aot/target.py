"""What `python -m rlver_jax.aot` compiles, as typed settings (the spec package holds both kinds).

A config file is either a training config (configs/grpo_think.py, ...), read into the run's own
`RunSpec` so that the tool plans exactly the run the trainer would start, or an aot config naming
its programs (configs/aot_forward.py), read into `ForwardSpec`. Everything else in `rlver_jax.aot`
takes one of the two (`Target`) and the models they describe as `ModelShape`.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Union

from rlver_jax.spec import RunSpec
from rlver_jax.spec.forward import ForwardSpec


Target = Union[RunSpec, ForwardSpec]


def from_config(config: Mapping) -> Target:
  """The typed target of a config file: an aot config names its `programs`; any other is a training
  config. ConfigError (a ValueError) names the first bad key."""
  if "programs" in config:
    return ForwardSpec.from_config(config)
  return RunSpec.from_config(config)


def is_run(target: Target) -> bool:
  return isinstance(target, RunSpec)


def with_policy(spec: RunSpec, **changes) -> RunSpec:
  return dataclasses.replace(spec, policy=dataclasses.replace(spec.policy, **changes))


def with_rollout_rows(spec: RunSpec, rows: int) -> RunSpec:
  """`spec` with `rollout.rows` set, checked as the config value would be."""
  return dataclasses.replace(spec, rollout=dataclasses.replace(spec.rollout, rows=rows))
