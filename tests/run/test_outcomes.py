"""A stop signal's outcome, exit status and last line come from one module that does not import jax
(the entry point uses it while jax is still loading)."""
import signal
import subprocess
import sys

from rlver_jax.run import outcomes


def test_each_signal_has_one_outcome_status_and_line():
  assert (outcomes.outcome_of(signal.SIGTERM), outcomes.exit_status(signal.SIGTERM)) == ("preempted", 75)
  assert (outcomes.outcome_of(signal.SIGINT), outcomes.exit_status(signal.SIGINT)) == ("interrupted", 130)
  for signum in (signal.SIGTERM, signal.SIGINT):
    assert outcomes.signal_of(outcomes.outcome_of(signum)) == signum
  assert outcomes.stopped_line(4, 10, signal.SIGINT) == (
      "interrupted at step 4 of 10; run the same command to resume")


def test_the_module_and_the_entry_points_early_handlers_load_without_jax():
  code = ("import sys, rlver_jax.run.outcomes; assert 'jax' not in sys.modules, 'jax was imported'")
  subprocess.run([sys.executable, "-c", code], check=True)
