"""How a run ends when a signal stops it, as a user and a retry loop see it: the outcome a signal
means, the process's exit status and the last line. No jax import, so the entry point can use it
while jax is still loading.

SIGTERM (a TPU preemption notice) is "preempted", exit 75 (EX_TEMPFAIL: try again later); Ctrl-C
(SIGINT) is "interrupted", exit 130 (what a shell reports for a program ended by Ctrl-C). Both leave
the last finished step saved, so the same command resumes.
"""
from __future__ import annotations

import signal

FINISHED, PREEMPTED, INTERRUPTED = "finished", "preempted", "interrupted"
PREEMPTED_EXIT = 75
INTERRUPTED_EXIT = 128 + signal.SIGINT


def outcome_of(signum: int | None) -> str:
  """The outcome a stop signal means (SIGTERM when none is known)."""
  return INTERRUPTED if signum == signal.SIGINT else PREEMPTED


def signal_of(outcome: str) -> int:
  return signal.SIGINT if outcome == INTERRUPTED else signal.SIGTERM


def exit_status(signum: int | None) -> int:
  return INTERRUPTED_EXIT if signum == signal.SIGINT else PREEMPTED_EXIT


def stopped_line(step: int, total: int, signum: int | None = signal.SIGTERM) -> str:
  """The last line of a run a signal stopped after saving step `step`."""
  return f"{outcome_of(signum)} at step {step} of {total}; run the same command to resume"
