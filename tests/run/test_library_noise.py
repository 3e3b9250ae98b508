"""What a failed checkpoint restore leaves behind stays off the console: a Future whose TensorStore
error nobody retrieved (set from TensorStore's threads, so it has no Python traceback) and a
coroutine orbax created and never awaited. Anything else still reaches the user."""
import asyncio
import gc
import logging
import sys
import warnings

import pytest

from rlver_jax.run import library_noise

_TS_TEXT = ('OUT_OF_RANGE: Error opening "zarr" driver: Error reading "w/.zarray": Requested byte '
            'range [0, 2880) is not valid for value of size 1440 [tensorstore_spec=\'{"driver":"zarr"}\']')


def _drop_failed_future(exc: BaseException) -> None:
  """A Future failed and dropped unretrieved: asyncio logs "Future exception was never retrieved"
  on the "asyncio" logger when it is collected."""
  loop = asyncio.new_event_loop()
  try:
    fut = loop.create_future()
    fut.set_exception(exc)
    del fut
    gc.collect()
  finally:
    loop.close()


def _never_retrieved(caplog) -> list[logging.LogRecord]:
  return [r for r in caplog.records
          if r.name == "asyncio" and "never retrieved" in r.getMessage() and r.levelno > logging.DEBUG]


def test_an_unretrieved_tensorstore_error_is_debug_only(caplog):
  library_noise.demote_library_tracebacks()
  with caplog.at_level(logging.INFO):
    _drop_failed_future(ValueError(_TS_TEXT))
  assert _never_retrieved(caplog) == []


def test_an_unretrieved_error_of_anything_else_is_still_reported(caplog):
  library_noise.demote_library_tracebacks()
  with caplog.at_level(logging.INFO):
    _drop_failed_future(ValueError("OUT_OF_RANGE: a status from somewhere else"))
  assert len(_never_retrieved(caplog)) == 1


@pytest.fixture
def library_module(tmp_path, monkeypatch):
  """A module that the filters take for orbax's (its folder joins their library paths)."""
  (tmp_path / "fake_orbax_reads.py").write_text("async def read_metadata():\n  return 1\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(library_noise, "_LIBRARIES", library_noise._LIBRARIES + (str(tmp_path) + "/",))
  import fake_orbax_reads
  yield fake_orbax_reads
  sys.modules.pop("fake_orbax_reads", None)


async def _own_coroutine():
  return 2


def _dropped_in_a_cycle(coroutine_fn) -> None:
  """A coroutine created and never awaited, reachable only through a reference cycle: plain
  reference counting never frees it, so without a collection it lasts until the process ends."""
  holder = {}
  holder["self"], holder["coroutine"] = holder, coroutine_fn()


def test_collecting_after_a_failed_restore_keeps_orbaxs_unawaited_coroutines_quiet(
    library_module, monkeypatch):
  shown = []
  monkeypatch.setattr(warnings, "showwarning", lambda *a, **k: shown.append(a[0]))
  gc.collect()
  _dropped_in_a_cycle(library_module.read_metadata)
  _dropped_in_a_cycle(_own_coroutine)
  library_noise.collect_restore_debris()
  assert [str(m) for m in shown] == ["coroutine '_own_coroutine' was never awaited"]


def test_an_unretrieved_error_that_passed_through_orbax_is_debug_only(caplog, library_module):
  """Its deepest frame is not the library's (a callback raised it), a frame above it is."""
  exec(compile("def call(f):\n  return f()\n", library_module.__file__, "exec"), library_module.__dict__)

  def fail():
    raise RuntimeError("a read failed")
  try:
    library_module.call(fail)
  except RuntimeError as e:
    error = e
  library_noise.demote_library_tracebacks()
  with caplog.at_level(logging.INFO):
    _drop_failed_future(error)
  assert _never_retrieved(caplog) == []
