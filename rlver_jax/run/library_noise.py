"""Keeps orbax's and TensorStore's echoes of a failed save or restore off the console.

Orbax logs each failure with its traceback from the thread where it happened, then raises it to
the caller, where `run.checkpoint` names it in one line. A failed restore also leaves reads in
flight: they finish after orbax closed their event loop, and Python prints each as an ignored
exception ("Event loop is closed", a dropped `_read_array_index_and_device_put` coroutine),
hundreds of tracebacks, some after the process's last line: a dropped read's Future whose
TensorStore error nobody retrieved, a coroutine orbax created and never awaited. All of it goes to
debug logging instead (--verbosity=1 shows it); anything else passes through untouched.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import sys
import warnings

import orbax.checkpoint
import tensorstore

_LIBRARIES = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                   for m in (orbax.checkpoint, tensorstore))
_log = logging.getLogger(__name__)
_TS_STATUS = re.compile(r"^[A-Z][A-Z_]+: .*\[tensorstore_spec=", re.S)


def _in_library(path: str) -> bool:
  return os.path.abspath(path).startswith(_LIBRARIES)


def _raised_in_library(exc_info) -> bool:
  """Whether any frame of the exception's traceback is orbax's or TensorStore's: a read awaited in
  orbax's coroutine and failed in a callback of ours, or re-raised by asyncio, passes through one."""
  tb = exc_info[2] if isinstance(exc_info, tuple) else None
  while tb is not None:
    if _in_library(tb.tb_frame.f_code.co_filename):
      return True
    tb = tb.tb_next
  return False


def _tensorstore_error(exc_info) -> bool:
  """An error TensorStore set on a Future from its own threads, or one re-raised from it: its text
  is TensorStore's status with the store's spec, traceback or not."""
  exc = exc_info[1] if isinstance(exc_info, tuple) else None
  return exc is not None and bool(_TS_STATUS.match(str(exc)))


def _is_own_wait(record: logging.LogRecord) -> bool:
  """Orbax's "Waiting for previous save to complete took N seconds" times every wait, including
  the one `run.checkpoint` makes before each save to surface the previous save's failure: on a
  busy host it fires on that deliberate wait, and its advice (save less often) does not apply."""
  return str(record.msg).startswith("Waiting for previous save to complete")


class _Demote(logging.Filter):
  """Debug records instead: orbax's records that carry a traceback, asyncio's about an exception
  raised in orbax or TensorStore (a read nobody awaited after a failed restore, reported whenever
  its Future is collected, up to the process's end), inside
  `reading_checkpoints` all of orbax's (a damaged checkpoint makes it log errors it then raises),
  and orbax's timing of our own wait before a save (`_is_own_wait`)."""

  def __init__(self):
    super().__init__()
    self.restoring = 0

  def filter(self, record: logging.LogRecord) -> bool:
    if record.name == "asyncio":
      echo = (self.restoring or _raised_in_library(record.exc_info)
              or _tensorstore_error(record.exc_info))
    else:
      echo = _in_library(record.pathname) and (record.exc_info or self.restoring
                                               or _is_own_wait(record))
    if not echo:
      return True
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_FILTER = _Demote()


def demote_library_tracebacks() -> None:
  """Idempotent; orbax logs through absl's logger."""
  for name in ("absl", "asyncio"):
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
      logger.addFilter(_FILTER)


def _is_restore_debris(u) -> bool:
  if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
    return True
  return _is_library_coroutine(u.object)  # a coroutine dropped with its read still pending


def _is_library_coroutine(obj) -> bool:
  code = getattr(obj, "cr_code", None)
  return code is not None and _in_library(code.co_filename)


def _filter_unraisable() -> None:
  """Idempotent. It stays installed: the debris keeps coming until the process ends."""
  previous = sys.unraisablehook
  if getattr(previous, "restore_debris_filter", False):
    return

  def hook(u):
    if _is_restore_debris(u):
      _log.debug("after a failed checkpoint restore: %s in %r", u.exc_value, u.object)
    else:
      previous(u)
  hook.restore_debris_filter = True
  sys.unraisablehook = hook


@contextlib.contextmanager
def reading_checkpoints():
  """Around reading checkpoints that may be damaged: their failures are raised and reported."""
  demote_library_tracebacks()
  _filter_unraisable()
  _FILTER.restoring += 1
  try:
    yield
  finally:
    _FILTER.restoring -= 1


def collect_restore_debris() -> None:
  """After a failed restore, once its exception is gone: frees what it left in reference cycles
  now, while the filters can place it. Left to the interpreter's teardown, a coroutine orbax never
  awaited prints "RuntimeWarning: coroutine ... was never awaited" after the filters are gone."""
  with reading_checkpoints(), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gc.collect()
  for w in caught:
    if _is_library_coroutine(w.source):
      _log.debug("after a failed checkpoint restore: %s", w.message)
    else:
      warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
