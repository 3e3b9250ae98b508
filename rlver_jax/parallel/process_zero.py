"""Work only process 0 does (the run's files), with its outcome shared by every process.

If process 0 alone raised (disk full, a path it cannot write), the other hosts would wait in their
next collective and the coordination service would abort all of them minutes later with an
unrelated "shutdown barrier" error. `on_process_zero` makes every process raise at the same point:
process 0 its own error, the others a one-line `ProcessZeroError` that names it.
`answers_from_process_zero` hands process 0's answers (e.g. a remote simulator's) to every process.
"""
from __future__ import annotations

import json
from typing import Callable, TypeVar

import jax

from rlver_jax.parallel.sharding import broadcast_bytes

T = TypeVar("T")


class ProcessZeroError(RuntimeError):
  """Raised on processes other than 0 when process 0's own part of a step failed."""


def on_process_zero(what: str, fn: Callable[[], T]) -> T | None:
  """Runs `fn` on process 0 only; returns its result there and None elsewhere.

  Every process must call this at the same point of the program (it takes part in a collective
  when there are several), and none goes on before process 0's work is done. `what` names the work
  in the other processes' error ("writing WORKDIR/metrics.jsonl").
  """
  if jax.process_count() == 1:
    return fn()
  result, error = None, None
  if jax.process_index() == 0:
    try:
      result = fn()
    except Exception as e:  # shared below, then re-raised: every host stops here
      error = e
  message = broadcast_bytes(
      # errors="replace": an unencodable message must not raise before process 0 joins the broadcast
      (f"{type(error).__name__}: {error}" if error is not None else "").encode("utf-8", "replace")
      if jax.process_index() == 0 else None)
  if error is not None:
    raise error
  if message:
    raise ProcessZeroError(f"process 0 failed {what}: {message.decode('utf-8')}")
  return result


def answers_from_process_zero(fetch: Callable[[], list], error: type[Exception]) -> list:
  """Runs `fetch` on process 0 only and hands its JSON-able answers (or its failure, raised as
  `error` everywhere) to every process.

  A sampled remote answer differs from call to call: if every host asked the server, hosts would
  parse different texts, append different token ids and run diverging collective programs.
  """
  if jax.process_count() == 1:
    return fetch()
  payload: dict = {}
  if jax.process_index() == 0:
    try:
      payload = {"answers": fetch()}
    except error as e:
      payload = {"error": str(e)}
    except Exception as e:  # every host must raise, or the others would wait in the next collective
      payload = {"error": f"{type(e).__name__}: {e}"}
  payload = json.loads(broadcast_bytes(json.dumps(payload).encode("utf-8")).decode("utf-8"))
  if "error" in payload:
    raise error(payload["error"])
  return payload["answers"]
