"""A quiet console for the command-line entry points.

Libraries log through absl at INFO (orbax prints dozens of lines per checkpoint, jax its backend
probing). Unless the user sets --verbosity (or -v) themselves, only this package's own INFO lines
and everyone's warnings and errors reach the terminal.
"""
from __future__ import annotations

import logging
import os

from absl import flags
from absl import logging as absl_logging

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class OwnInfoOnly(logging.Filter):
  """Passes warnings and errors from anywhere, lower levels only from this package."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or os.path.abspath(record.pathname).startswith(_PACKAGE)


_FILTER = OwnInfoOnly()


def quiet_library_logs() -> bool:
  """Hides library INFO logs unless --verbosity was given; call after flag parsing. Returns whether
  it did."""
  if flags.FLAGS["verbosity"].present:
    return False
  handler = absl_logging.get_absl_handler()
  if _FILTER not in handler.filters:
    handler.addFilter(_FILTER)
  return True
