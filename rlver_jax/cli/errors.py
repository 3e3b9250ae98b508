"""How the command-line entry points end on an error they catch.

A problem this package detected and named (a bad flag, config value, path) is one line and exit 1.
A ValueError raised inside a library (a shape mismatch deep in JAX, say) is most likely a bug, and
one line would hide where it came from, so its traceback is printed above that line.
"""
from __future__ import annotations

import os
import sys
import traceback

from absl import logging

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def raised_here(e: BaseException) -> bool:
  """Whether `e` was raised by this package's own code rather than inside a library."""
  tb = e.__traceback__
  if tb is None:
    return True
  while tb.tb_next is not None:
    tb = tb.tb_next
  return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE)


def exit_on(e: BaseException, prefix: str = "error") -> None:
  if isinstance(e, ValueError) and not raised_here(e):
    traceback.print_exception(e)
  else:
    logging.debug("error", exc_info=e)  # --verbosity=1 shows it
  sys.exit(f"{prefix}: {e}")
