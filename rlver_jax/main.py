r"""Train a policy with RLVER.

  python -m rlver_jax.main --config=configs/grpo_think.py[:runlocal] [--workdir=DIR]

Re-running the same command resumes from WORKDIR/checkpoints. Config values are overridden with
--config.KEY=VALUE (every key and its default: rlver_jax/spec/).

Exit status: 0 finished; 75 preempted (SIGTERM: the last finished step was saved, run the same
command to resume); 130 interrupted (Ctrl-C: the same, and a second Ctrl-C exits at once, keeping
every checkpoint already written); 1 an error, named in one line (also a --workdir that another run
is using, or one that holds files but is not a run's).
"""
from __future__ import annotations

import os
import signal
import sys

from rlver_jax.run.outcomes import exit_status, outcome_of  # no jax import


def _stopped_while_starting(signum, _frame):
  sys.stderr.write(f"{outcome_of(signum)} while starting; run the same command to resume\n")
  sys.stderr.flush()
  # os._exit, not sys.exit: the handler runs inside whatever import is under way, and a SystemExit
  # raised there can be caught by it (a run went on training after this line). Nothing to save yet.
  os._exit(exit_status(signum))


def _stopped_after_training(signum, _frame):
  sys.stderr.write(f"{outcome_of(signum)} while printing the summary; everything the run wrote is "
                   "saved\n")
  sys.stderr.flush()
  os._exit(exit_status(signum))


if __name__ == "__main__":  # until the trainer's own handler takes over: nothing to save yet
  if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # ignored: started in the background
    signal.signal(signal.SIGINT, _stopped_while_starting)  # not a KeyboardInterrupt from inside jax
  signal.signal(signal.SIGTERM, _stopped_while_starting)

import datetime  # noqa: E402

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from rlver_jax.parallel import distributed  # noqa: E402
from rlver_jax.cli.errors import exit_on  # noqa: E402
from rlver_jax.run.workdir import check_workdir, new_run_dir, remove_if_unused  # noqa: E402
from rlver_jax.run.workdir_lock import LOCK_FILE, lock_workdir  # noqa: E402
from rlver_jax.cli.flags import parse_flags  # noqa: E402

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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  distributed.initialize()
  from rlver_jax.train import loop  # after distributed init: imports may touch devices
  from rlver_jax.train.summary import print_run_end
  from rlver_jax.spec import RunSpec
  from rlver_jax.env.backends import SimulatorBackendError
  from rlver_jax.parallel.process_zero import ProcessZeroError, on_process_zero
  from rlver_jax.models.io import storage
  from rlver_jax.run import compile_cache
  storage.point_clients_at_emulator()
  workdir = _WORKDIR.value or _default_workdir()
  try:
    check_workdir(workdir)  # before any model loads
    spec = RunSpec.from_config(_CONFIG.value)  # checks every setting, also those used late
    # Held until the process ends (never released: the kernel does it, also on kill -9).
    lock = on_process_zero(f"locking --workdir={workdir}", lambda: lock_workdir(workdir))  # noqa: F841
    compile_cache.enable(compile_cache.resolve(spec.compile_cache_dir, workdir))
    paths = loop.run(spec, workdir, ctrl_c=True)
    for signum in (signal.SIGINT, signal.SIGTERM):  # the trainer's handlers are gone with it
      if signal.getsignal(signum) is not signal.SIG_IGN:
        signal.signal(signum, _stopped_after_training)
  # Bad input, an unwritable workdir, a simulator that cannot answer within its retry bound (on any
  # host), or a diverged update: one line, non-zero exit (--verbosity=1 logs the traceback).
  except (ValueError, OSError, SimulatorBackendError, ProcessZeroError, loop.TrainingDiverged) as e:
    if not _WORKDIR.value:
      remove_if_unused(workdir, LOCK_FILE)
    exit_on(e)
  sys.exit(print_run_end(workdir, spec, paths))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
