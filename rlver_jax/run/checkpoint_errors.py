"""The one-line reports of a checkpoint that cannot be saved or restored, and the detail behind them.

Orbax wraps TensorStore's errors in its own, whose text embeds a bound method's repr where it meant
the store's spec; the words that say what went wrong are on the innermost cause, e.g.
`OUT_OF_RANGE: Error reading "w/0" in OCDBT database at ...: Requested byte range [0, 10355) is not
valid for value of size 5311 [tensorstore_spec=...]`.
"""
from __future__ import annotations

import errno
import os
import re

_FULL = {errno.ENOSPC, errno.EDQUOT}
_STATUS = re.compile(r"^([A-Z][A-Z_]+): (.*)$", re.S)  # absl::Status text, as TensorStore raises it
_ENTRY = re.compile(r'Error (reading|writing) "([^"]+)"')
_TS_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")
_TRAILER = re.compile(r"\s*\[(?:tensorstore_spec|source locations|os_error_code).*$", re.S)


class NoRestorableCheckpoint(ValueError):
  """Every checkpoint under the run's checkpoints/ folder failed to restore."""


class DamagedCheckpoint(ValueError):
  """A restored array differs from what was saved, or holds NaN / inf; the message names it."""


class NonFiniteState(ValueError):
  """The state to save holds NaN / inf; nothing was saved."""


class CheckpointNotSaved(OSError):
  """A checkpoint could not be written (disk full, storage error); the message is the whole report."""


def describe(e: BaseException, limit: int = 240) -> str:
  """What went wrong, in one line: the innermost cause's own words without the spec dumps."""
  if isinstance(e, DamagedCheckpoint):
    return str(e)
  while e.__cause__ is not None:
    e = e.__cause__
  text = str(e).split(" See full TensorStore details:")[0]
  text = _TRAILER.sub("", text).strip()
  status = _STATUS.match(text)
  if status:  # CODE: Error opening ...: Error reading "w/0" in ... at local file "PATH": <what>
    code, rest = status.groups()
    entry = _ENTRY.search(rest)
    where = f' {entry.group(1)} "{entry.group(2)}"' if entry else ""
    text = f"{code}{where}: {rest.rsplit(chr(34) + ': ', 1)[-1]}"
  else:
    text = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
  text = " ".join(text.split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _os_error_code(e: BaseException) -> int | None:
  if isinstance(e, OSError) and e.errno is not None:
    return e.errno
  code = _TS_OS_ERROR.search(str(e))
  return int(code.group(1)) if code else None


def _chain(e: BaseException):
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


def full_disk_errno(e: BaseException) -> int | None:
  """ENOSPC or EDQUOT if `e` (or what caused it) says the storage is full, else None."""
  for x in _chain(e):
    if _os_error_code(x) in _FULL:
      return _os_error_code(x)
    if "No space left on device" in str(x):
      return errno.ENOSPC
  return None


def is_storage_error(e: BaseException) -> bool:
  """An OSError or a TensorStore status error: the storage failed, not this package's code."""
  return any(isinstance(x, OSError) or (isinstance(x, ValueError) and _STATUS.match(str(x)))
             for x in _chain(e))


def not_saved_line(step: int, path: str, e: BaseException, earlier: int | None) -> str:
  full = full_disk_errno(e)
  if full is not None:
    head = f"disk full while saving the checkpoint of step {step} to {path} ({os.strerror(full)})"
    todo = "free space and run the same command"
  else:
    head = f"could not save the checkpoint of step {step} to {path} ({describe(e)})"
    todo = "fix that and run the same command"
  if earlier is None:
    return f"{head}; there is no earlier checkpoint, so the run will start over from step 0; {todo}"
  return f"{head}; the checkpoint of step {earlier} is intact; {todo} to resume"


def no_restorable_line(directory: str, failed: list[tuple[int, str]]) -> str:
  steps = ", ".join(str(s) for s, _ in failed)
  newest, why = failed[0]
  return (f"no checkpoint in {directory} restores (tried step{'s' if len(failed) > 1 else ''} "
          f"{steps}; step {newest}: {why}); nothing was moved or deleted; to start over from step 0, "
          f"move {directory} away (e.g. to {directory}.damaged) or pass another --workdir")
