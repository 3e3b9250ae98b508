"""Text generators behind the simulated user: the backend protocol, a scripted and an HTTP backend.

A backend keeps one append-only chat message list per dialogue row. Each `generate` call hands it,
per row, only the messages added since the last call (`SimRequest.new_messages`); the backend
appends them, generates, and appends its own answer as an assistant message. A co-located model
backend can therefore keep a per-row KV cache and prefill only the new messages. `rewind` (the
reference information flow) drops a row's latest messages; `prefill` appends without generating.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from typing import Protocol, Sequence, runtime_checkable

import jax
from absl import logging

from rlver_jax.env import scripted_rules
from rlver_jax.env.profiles import Profile, intention_key, personality_key
from rlver_jax.parallel.process_zero import answers_from_process_zero

Message = dict[str, str]
# "retry" re-asks the emotion step, "reply_retry" the opening or reply step.
KINDS = ("opening", "emotion", "reply", "retry", "reply_retry")


@dataclasses.dataclass(frozen=True)
class SimRequest:
  """One generation for one dialogue row.

  `new_messages` are the messages appended to that row's context since the previous call, in
  order. The other fields are structured side information for rule-based backends; model backends
  only need `row` and `new_messages`.
  """
  row: int
  new_messages: tuple[Message, ...]
  kind: str
  profile: Profile
  language: str
  policy_reply: str | None = None
  emotion: int = 0
  state: str = ""

  def __post_init__(self):
    object.__setattr__(self, "new_messages", tuple(self.new_messages))
    if self.kind not in KINDS:
      raise ValueError(f"unknown request kind {self.kind!r}; expected one of {KINDS}")


@runtime_checkable
class SimulatorBackend(Protocol):
  """What the simulated-user driver and the trainer need from a text generator.

  `HistoryBackend` gives every optional capability its default answer (no context bound, no
  sampling key, no request counts), so a backend declares what it has instead of being probed.
  """

  prefill_tokens: int | None  # tokens run as model input over all calls; None: not a local model
  cut_answers: int | None  # answers cut at max_new_tokens over all calls; None: not counted
  last_error: str | None  # the last failed request's error (None: none failed, or not tracked)
  reads_context: bool  # whether answers follow the messages (the info_flow applies); scripted: no
  scores_changes: bool  # whether `expected_changes` works (a local model only: an API has no logits)

  def reset(self, num_rows: int) -> None:
    """Forgets every row's context and prepares `num_rows` empty ones."""

  def generate(self, requests: Sequence[SimRequest]) -> list[str | None]:
    """Appends each request's new messages to its row, generates, returns texts in request order.
    A remote backend answers None for a request that failed within its retry bound: that dialogue
    ends as `simulator_error` and the others go on."""

  def is_full(self, row: int) -> bool:
    """Whether the row's context has no room left (its answers are then empty; the dialogue ends)."""

  def clone_rows(self, sources: dict[int, int]) -> None:
    """Makes each row `dst` a copy of row `sources[dst]` (its whole context so far)."""

  def prefill(self, messages: dict[int, Sequence[Message]]) -> None:
    """Appends messages to rows without generating (a model computes their KV rows now, so a
    `clone_rows` after it copies them instead of every copy computing them)."""

  def rewind(self, keep: dict[int, int]) -> None:
    """Drops each row's messages after its first `keep[row]` (a model sets its KV rows back). The
    kept messages must end where a message of ours ended, not inside a generated answer."""

  def history(self, row: int) -> list[Message]:
    """A copy of one row's full message list."""

  def release(self, row: int) -> None:
    """The row's dialogue has ended: whatever it holds on a device may go to another dialogue."""

  def reseed(self, key: jax.Array) -> None:
    """Sets the sampling key (a sampling backend draws from it; the others ignore it)."""

  def take_counts(self) -> dict[str, int]:
    """Request counts since the last call, then zeroed (the HTTP backend's; else empty)."""

  def server(self) -> str:
    """Where the answers come from, for error messages (a URL, else the backend's class)."""

  def expected_changes(self, value_offsets: dict[int, int]) -> dict[int, float]:
    """Per row, the mean change under the backend's own distribution over the allowed values, at
    `value_offsets[row]` in the text of the row's last answer (`env.expected_change`)."""


class SimulatorBackendError(RuntimeError):
  """A backend could not produce an answer within its retry bound."""


def failure_context(backend: SimulatorBackend) -> str:
  """"last error: ...; server ..." for a message about failed requests."""
  return f"last error: {backend.last_error}; server {backend.server()}"


class HistoryBackend:
  """Shared bookkeeping (the per-row append-only message lists) and the default answers of the
  optional `SimulatorBackend` capabilities; every backend derives from it."""

  prefill_tokens: int | None = None
  cut_answers: int | None = None
  last_error: str | None = None
  reads_context: bool = True
  scores_changes = False

  def __init__(self):
    self._histories: list[list[Message]] = []

  def reset(self, num_rows: int) -> None:
    self._histories = [[] for _ in range(num_rows)]

  def history(self, row: int) -> list[Message]:
    """A copy of one row's full message list."""
    return [dict(m) for m in self._histories[row]]

  def _extend(self, requests: Sequence[SimRequest]) -> None:
    rows = [r.row for r in requests]
    if len(set(rows)) != len(rows):
      raise ValueError(f"a generate call may hold each row once; got rows {rows}")
    for r in requests:
      self._check_row(r.row)
    for r in requests:
      self._histories[r.row].extend(dict(m) for m in r.new_messages)

  def _check_row(self, row: int) -> None:
    if not 0 <= row < len(self._histories):
      raise IndexError(f"row {row} out of range; reset() was called with {len(self._histories)} rows")

  def prefill(self, messages: dict[int, Sequence[Message]]) -> None:
    for row, new in messages.items():
      self._check_row(row)
      self._histories[row].extend(dict(m) for m in new)

  def rewind(self, keep: dict[int, int]) -> None:
    for row, n in keep.items():
      self._check_row(row)
      if not 0 <= n <= len(self._histories[row]):
        raise ValueError(f"row {row}: cannot keep {n} of its {len(self._histories[row])} messages")
      del self._histories[row][n:]

  def clone_rows(self, sources: dict[int, int]) -> None:
    for dst, src in sources.items():
      self._histories[dst] = [dict(m) for m in self._histories[src]]

  def _answer(self, row: int, text: str) -> None:
    self._histories[row].append({"role": "assistant", "content": text})

  def is_full(self, row: int) -> bool:
    return False  # remote servers and the scripted rules have no context bound we track

  def release(self, row: int) -> None:
    del row  # a history costs no device memory: kept for the transcripts

  def reseed(self, key: jax.Array) -> None:
    del key  # deterministic or remotely sampled: no key of ours to set

  def take_counts(self) -> dict[str, int]:
    return {}

  def take_draft_metrics(self) -> dict[str, float]:
    """A draft model's acceptance since the last call, then zeroed (a model backend's; else {})."""
    return {}

  def server(self) -> str:
    return type(self).__name__

  def expected_changes(self, value_offsets: dict[int, int]) -> dict[int, float]:
    raise NotImplementedError(f"{self.server()} gives no distribution over the change values")


class ScriptedBackend(HistoryBackend):
  """Deterministic rule-based simulator; see `scripted_rules` for the scoring rules.

  Emotion and retry steps score `policy_reply` against the profile's hidden intention and answer
  with labelled sections ending in `Change: +N` / `变化：+N`, so the real parser is exercised.
  Reply steps and reply retries answer with a templated `Reply: ...` line for the emotion state (a
  goodbye at S and F); the opening is templated too, so no run against it ever re-asks a reply.
  Answers are in `SimRequest.language`. They never read the messages (only the request's fields
  and how many messages came before), so `reads_context` is False: the information flow does not
  apply and the simulated users keep one growing chat with it.
  """

  reads_context = False

  def generate(self, requests: Sequence[SimRequest]) -> list[str]:
    self._extend(requests)
    out = [self._one(r) for r in requests]
    for r, text in zip(requests, out):
      self._answer(r.row, text)
    return out

  def _one(self, r: SimRequest) -> str:
    passive = personality_key(r.profile) == "passive"
    key = f"{r.profile.id}/{len(self._histories[r.row])}"
    # A reply retry before any policy reply re-asks the opening.
    if r.kind == "opening" or r.kind == "reply_retry" and r.policy_reply is None:
      return scripted_rules.opening_text(r.language, key, passive)
    if r.kind in ("emotion", "retry"):
      score = scripted_rules.score_reply(r.policy_reply or "", intention_key(r.profile))
      return scripted_rules.analysis_text(score, r.language)
    return scripted_rules.reply_text(r.state, r.language, key, passive)


@dataclasses.dataclass(frozen=True)
class HttpSettings:
  """Connection and sampling settings of the OpenAI-compatible backend (all explicit, loggable)."""
  base_url: str
  model: str
  api_key_env: str = "OPENAI_API_KEY"
  temperature: float = 0.7
  top_p: float = 1.0
  max_tokens: int = 1024
  timeout_s: float = 120.0        # per connect / read
  deadline_s: float = 300.0       # per attempt, connect to last byte (a trickling server)
  max_attempts: int = 4
  backoff_s: float = 1.0
  max_backoff_s: float = 30.0
  max_concurrency: int = 8


HTTP_COUNTS = ("attempts", "retries", "failed_requests")


class _Retryable(Exception):
  """A failure worth another attempt."""


class OpenAIChatBackend(HistoryBackend):
  """Stateless OpenAI-compatible chat API: each call POSTs the row's full message list.

  The API key is read from the environment variable named by `api_key_env` (no header is sent when
  it is unset, for local servers). The key is never logged nor put into an error message.
  """

  def __init__(self, base_url: str, model: str, **options):
    """`options` are the remaining `HttpSettings` fields (sampling, timeout, retries, ...)."""
    super().__init__()
    settings = HttpSettings(base_url, model, **options)
    if settings.max_attempts < 1 or settings.max_concurrency < 1:
      raise ValueError("max_attempts and max_concurrency must be >= 1")
    self.settings = settings
    self._url = settings.base_url.rstrip("/") + "/chat/completions"
    self._split = urllib.parse.urlsplit(self._url)
    if self._split.scheme not in ("http", "https") or not self._split.hostname:
      raise ValueError(f"simulator base URL {settings.base_url!r}: expected http(s)://HOST[:PORT]/...")
    self._path = self._split.path or "/chat/completions"
    self._lock = threading.Lock()
    self._counts = dict.fromkeys(HTTP_COUNTS, 0)
    self.last_error: str | None = None  # of the last request that failed after its attempts

  def __repr__(self) -> str:
    s = self.settings
    return (f"OpenAIChatBackend(base_url={s.base_url!r}, model={s.model!r}, "
            f"api_key_env={s.api_key_env!r})")

  def generate(self, requests: Sequence[SimRequest]) -> list[str | None]:
    self._extend(requests)
    bodies = [self._body(self._histories[r.row]) for r in requests]
    answers = answers_from_process_zero(lambda: self._post_all(bodies),
                                        SimulatorBackendError)
    for r, text in zip(requests, answers):
      if text is not None:  # a failed row's dialogue ends: its history is never sent again
        self._answer(r.row, text)
    return answers

  def server(self) -> str:
    return self.settings.base_url

  def take_counts(self) -> dict[str, int]:
    """HTTP attempts, retries and failed requests since the last call (then zeroed)."""
    with self._lock:
      out, self._counts = self._counts, dict.fromkeys(HTTP_COUNTS, 0)
    return out

  def _count(self, key: str, error: str | None = None) -> None:
    with self._lock:
      self._counts[key] += 1
      if error is not None:
        self.last_error = error

  def _post_all(self, bodies: list[bytes]) -> list[str]:
    workers = min(self.settings.max_concurrency, max(len(bodies), 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
      return list(pool.map(self._post_with_retries, bodies))

  def _body(self, messages: list[Message]) -> bytes:
    s = self.settings
    payload = {"model": s.model, "messages": messages, "temperature": s.temperature,
               "top_p": s.top_p, "max_tokens": s.max_tokens}
    return json.dumps(payload, ensure_ascii=False).encode("utf-8")

  def _post_with_retries(self, body: bytes) -> str | None:
    """The answer, or None once the attempts are spent (or on an error no retry fixes)."""
    s = self.settings
    problem = "no attempt made"
    for attempt in range(s.max_attempts):
      if attempt:
        logging.warning("simulator POST %s: %s; retrying (attempt %d of %d)", self._path, problem,
                        attempt + 1, s.max_attempts)
        self._count("retries")
        time.sleep(min(s.backoff_s * 2 ** (attempt - 1), s.max_backoff_s))
      self._count("attempts")
      try:
        return self._post_once(body)
      except _Retryable as e:
        problem = str(e)
      except SimulatorBackendError as e:
        self._count("failed_requests", str(e))
        return None
    self._count("failed_requests", self._scrub(
        f"POST {self._path} failed after {s.max_attempts} attempts: {problem}"))
    return None

  def _post_once(self, body: bytes) -> str:
    s = self.settings
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(s.api_key_env, "")
    if key:
      headers["Authorization"] = f"Bearer {key}"
    u = self._split
    end = time.monotonic() + s.deadline_s
    left = lambda: end - time.monotonic()
    kind = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = kind(u.hostname, u.port, timeout=min(s.timeout_s, s.deadline_s))
    try:
      conn.request("POST", self._path + (f"?{u.query}" if u.query else ""), body=body, headers=headers)
      sock = conn.sock  # the response may take it over (conn.sock is then None)
      sock.settimeout(max(min(s.timeout_s, left()), 0.001))
      response = conn.getresponse()
      if response.status in (408, 409, 429) or response.status >= 500:
        raise _Retryable(f"HTTP {response.status}")
      if response.status >= 400:  # bad key, bad model name: no retry will fix them
        raise SimulatorBackendError(self._scrub(f"POST {self._path} failed: HTTP {response.status}"))
      chunks = []
      while True:  # each read bounded by what is left of the deadline, so a trickle cannot last
        if left() <= 0:
          raise _Retryable(f"no complete answer within the {s.deadline_s:g} s deadline")
        sock.settimeout(min(s.timeout_s, left()))
        chunk = response.read1(1 << 16)
        if not chunk:
          break
        chunks.append(chunk)
    except (TimeoutError, socket.timeout):
      if left() <= 0:
        raise _Retryable(f"no complete answer within the {s.deadline_s:g} s deadline") from None
      raise _Retryable(f"timed out after {s.timeout_s:g} s") from None
    except http.client.HTTPException as e:  # e.g. a truncated body, a garbage status line
      raise _Retryable(f"bad HTTP response ({type(e).__name__})") from None
    except OSError as e:  # connection refused or reset, unknown host
      raise _Retryable(f"connection error ({type(e).__name__})") from None
    finally:
      conn.close()
    return _content(b"".join(chunks))

  def _scrub(self, message: str) -> str:
    key = os.environ.get(self.settings.api_key_env, "")
    return message.replace(key, "***") if key else message


def _content(raw: bytes) -> str:
  """choices[0].message.content of a response body; malformed bodies are retryable failures.
  (An answer cut at max_tokens needs no flag: without its reply line it is re-asked anyway.)"""
  try:
    data = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError):
    raise _Retryable("response is not valid JSON") from None
  try:
    content = data["choices"][0]["message"]["content"]
  except (KeyError, IndexError, TypeError):
    raise _Retryable("response lacks choices[0].message.content") from None
  if not isinstance(content, str):
    raise _Retryable("choices[0].message.content is not a string")
  return content
