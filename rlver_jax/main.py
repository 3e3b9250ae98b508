r"""Train a policy with RLVER.

  python -m rlver_jax.main --config=configs/grpo_think.py[:runlocal] [--workdir=DIR]

Re-running the same command resumes from WORKDIR/checkpoints. Config values are overridden with
--config.KEY=VALUE (see configs/base.py for every key).
"""
from __future__ import annotations

import datetime
import os

import jax
from absl import app, flags
from ml_collections import config_flags

from rlver_jax import distributed
from rlver_jax.cli_errors import exit_on
from rlver_jax.files import new_run_dir
from rlver_jax.run_config import parse_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/grpo_think.py.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (local or gs://); default ./runs/NAME-TIME.")
flags.mark_flags_as_required(["config"])


def _default_workdir() -> str:
  if jax.process_count() > 1:  # each host would take its own timestamp
    raise app.UsageError("--workdir is required when running as several processes")
  filename = config_flags.get_config_filename(flags.FLAGS["config"])
  name = os.path.splitext(os.path.basename(filename.split(":")[0]))[0]
  try:
    return new_run_dir("runs", f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
  except FileExistsError as e:
    raise app.UsageError(str(e)) from None


def _remove_if_empty(path: str) -> None:
  """A default workdir made for a run that failed before writing anything is not left behind."""
  try:
    os.rmdir(path)
  except OSError:  # not empty (or already gone): keep what the run wrote
    pass


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  distributed.initialize()
  from rlver_jax import train  # after distributed init: imports may touch devices
  from rlver_jax.env.backends import SimulatorBackendError
  from rlver_jax.process_zero import ProcessZeroError
  from rlver_jax.models import storage
  storage.point_clients_at_emulator()
  workdir = _WORKDIR.value or _default_workdir()
  try:
    paths = train.run(_CONFIG.value, workdir)
  # Bad input, an unwritable workdir, a simulator that cannot answer within its retry bound (on any
  # host), or a diverged update: one line, non-zero exit (--verbosity=1 logs the traceback).
  except (ValueError, OSError, SimulatorBackendError, ProcessZeroError, train.TrainingDiverged) as e:
    if not _WORKDIR.value:
      _remove_if_empty(workdir)
    exit_on(e)
  if jax.process_index() != 0:  # one summary per run, not one per host
    return
  print(f"\nrun finished at step {paths.pop('step')}; outputs under {workdir}:")
  for k, v in paths.items():
    print(f"  {k:12s} {v}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
