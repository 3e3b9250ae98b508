"""A training run's workdir bookkeeping at start, in the order that leaves nothing wrong behind: every
check that needs the workdir or the inputs before any model loads, and the records (config.json,
provenance.json) written only once the run's parts have loaded."""
from __future__ import annotations

from typing import Sequence

from rlver_jax.run import provenance
from rlver_jax.run.saved_config import (check_inputs_on_every_host, check_shared_workdir,
                                        check_workdir_config, write_workdir_config)
from rlver_jax.spec import RunSpec


def check_before_loading(spec: RunSpec, workdir: str, input_paths: Sequence[str]) -> None:
  """One workdir shared by every host, every input file on every host, and a saved config.json (a
  resumed run's) that agrees with this one."""
  check_shared_workdir(workdir)
  check_inputs_on_every_host(input_paths)
  check_workdir_config(spec.source, workdir)


def provenance_of(spec: RunSpec, workdir: str, profiles) -> dict:
  """What this start records (code version, prompt texts, profiles), checked against the workdir's
  earlier starts."""
  return provenance.check(spec, workdir, profiles)


def record_start(spec: RunSpec, workdir: str, start: dict, layouts: dict[str, str]) -> None:
  """config.json and this start's provenance (with the models' layouts), once everything loaded."""
  write_workdir_config(spec.source, workdir)
  provenance.append(workdir, {**start, "layouts": layouts})
