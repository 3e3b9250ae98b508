"""The console's progress display: a bar on a terminal or in a notebook, plain lines elsewhere.

Used for training steps (train/loop.py) and evaluation dialogues (evaluation/sentient.py).
"""
from __future__ import annotations

import contextlib
import sys

from absl import logging


class _AboveBar:
  """stderr while the bar is drawn: each whole line written to it (a warning, a log record, the
  preemption line) clears the bar, is written, and the bar is drawn again below it."""

  def __init__(self, stream):
    self._stream = stream
    self._pending = ""

  def write(self, text: str) -> int:
    from tqdm import tqdm
    with tqdm.get_lock():  # the bar's own lock: a watcher thread may write while the bar redraws
      self._pending += text
      done, newline, self._pending = self._pending.rpartition("\n")
      if newline:
        with tqdm.external_write_mode(file=self._stream, nolock=True):
          self._stream.write(done + newline)
          self._stream.flush()
    return len(text)

  def flush(self) -> None:
    self._stream.flush()

  def finish(self) -> None:
    """Writes what is left of an unfinished line."""
    if self._pending:
      self.write("\n")

  def __getattr__(self, name):  # fileno, isatty, encoding: the real stream's
    return getattr(self._stream, name)


@contextlib.contextmanager
def _lines_above_bar(stream):
  """Routes sys.stderr (Python warnings, direct writes) and absl's handler through `_AboveBar`."""
  above = _AboveBar(stream)
  handler = logging.get_absl_handler().python_handler
  swap_handler = handler.stream is stream  # else it writes to a log file: left alone
  sys.stderr = above
  if swap_handler:
    handler.stream = above  # the same object as sys.stderr, or absl writes each record twice
  try:
    yield
  finally:
    above.finish()
    sys.stderr = stream
    if swap_handler:
      handler.stream = stream


def _interactive(stream) -> bool:
  """A terminal or a notebook (both redraw a line on a carriage return); not a log file or pipe."""
  return stream.isatty() or type(stream).__module__.startswith("ipykernel")


class Progress:
  """Progress on stderr. On a terminal or in a notebook: a bar, with every stderr line (warnings, log
  records) written above it. Elsewhere (stderr sent to a file): one plain line per update, since the
  bar's carriage-return frames would fill the file. `enabled=False`: nothing."""

  def __init__(self, total: int, initial: int, enabled: bool, *, desc: str = "rlver",
               unit: str = "step"):
    self._stream = sys.stderr
    self._total, self._done, self._enabled = total, initial, enabled
    self._desc, self._unit = desc, unit
    self._bar = None
    self._redirect = contextlib.ExitStack()
    if enabled and _interactive(self._stream):
      from tqdm import tqdm
      self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self._stream)
      self._redirect.enter_context(_lines_above_bar(self._stream))

  def update(self, n: int, fields: dict[str, str]) -> None:
    """`n` more done; `fields` shown beside the bar or on the plain line."""
    self._done += n
    if self._bar is not None:
      self._bar.update(n)
      self._bar.set_postfix(fields)
    elif self._enabled:
      values = " ".join(f"{k}={v}" for k, v in fields.items())
      self._stream.write(f"{self._desc} {self._unit} {self._done}/{self._total}: {values}\n")
      self._stream.flush()

  def write(self, line: str) -> None:
    """One line on stdout (above the bar, if any); printed even when the progress is off."""
    if self._bar is not None:
      from tqdm import tqdm
      tqdm.write(line)
    else:
      print(line, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    self._redirect.close()
