"""Text generators behind the simulated user: the backend protocol, a scripted and an HTTP backend.

A backend keeps one append-only chat message list per dialogue row. Each `generate` call hands it,
per row, only the messages added since the last call (`SimRequest.new_messages`); the backend
appends them, generates, and appends its own answer as an assistant message. A co-located model
backend can therefore keep a per-row KV cache and prefill only the new messages.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Protocol, Sequence

import jax

from rlver_jax.env import scripted_rules
from rlver_jax.env.profiles import Profile, intention_key, personality_key
from rlver_jax.sharding import broadcast_bytes

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


class SimulatorBackend(Protocol):
  """What the simulated-user driver needs from a text generator."""

  def reset(self, num_rows: int) -> None:
    """Forgets every row's context and prepares `num_rows` empty ones."""

  def generate(self, requests: Sequence[SimRequest]) -> list[str]:
    """Appends each request's new messages to its row, generates, returns texts in request order."""

  def is_full(self, row: int) -> bool:
    """Whether the row's context has no room left (its answers are then empty; the dialogue ends)."""


class SimulatorBackendError(RuntimeError):
  """A backend could not produce an answer within its retry bound."""


class HistoryBackend:
  """Shared bookkeeping: the per-row append-only message lists."""

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
      if not 0 <= r.row < len(self._histories):
        raise IndexError(
            f"row {r.row} out of range; reset() was called with {len(self._histories)} rows")
    for r in requests:
      self._histories[r.row].extend(dict(m) for m in r.new_messages)

  def _answer(self, row: int, text: str) -> None:
    self._histories[row].append({"role": "assistant", "content": text})

  def is_full(self, row: int) -> bool:
    return False  # remote servers and the scripted rules have no context bound we track


class ScriptedBackend(HistoryBackend):
  """Deterministic rule-based simulator; see `scripted_rules` for the scoring rules.

  Emotion and retry steps score `policy_reply` against the profile's hidden intention and answer
  with labelled sections ending in `Change: +N` / `变化：+N`, so the real parser is exercised.
  Reply steps and reply retries answer with a templated `Reply: ...` line for the emotion state (a
  goodbye at S and F); the opening is templated too, so no run against it ever re-asks a reply.
  Answers are in `SimRequest.language`.
  """

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
  timeout_s: float = 120.0
  max_attempts: int = 4
  backoff_s: float = 1.0
  max_backoff_s: float = 30.0
  max_concurrency: int = 8


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
    self._path = urllib.parse.urlparse(self._url).path or "/chat/completions"

  def __repr__(self) -> str:
    s = self.settings
    return (f"OpenAIChatBackend(base_url={s.base_url!r}, model={s.model!r}, "
            f"api_key_env={s.api_key_env!r})")

  def generate(self, requests: Sequence[SimRequest]) -> list[str]:
    self._extend(requests)
    bodies = [self._body(self._histories[r.row]) for r in requests]
    answers = _on_process_zero(lambda: self._post_all(bodies))
    out = []
    for r, text in zip(requests, answers):
      self._answer(r.row, text)
      out.append(text)
    return out

  def _post_all(self, bodies: list[bytes]) -> list[str]:
    workers = min(self.settings.max_concurrency, max(len(bodies), 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
      return list(pool.map(self._post_with_retries, bodies))

  def _body(self, messages: list[Message]) -> bytes:
    s = self.settings
    payload = {"model": s.model, "messages": messages, "temperature": s.temperature,
               "top_p": s.top_p, "max_tokens": s.max_tokens}
    return json.dumps(payload, ensure_ascii=False).encode("utf-8")

  def _post_with_retries(self, body: bytes) -> str:
    s = self.settings
    problem = "no attempt made"
    for attempt in range(s.max_attempts):
      if attempt:
        time.sleep(min(s.backoff_s * 2 ** (attempt - 1), s.max_backoff_s))
      try:
        return self._post_once(body)
      except _Retryable as e:
        problem = str(e)
    raise SimulatorBackendError(self._scrub(
        f"POST {self._path} failed after {s.max_attempts} attempts: {problem}"))

  def _post_once(self, body: bytes) -> str:
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(self.settings.api_key_env, "")
    if key:
      headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(self._url, data=body, headers=headers, method="POST")
    try:
      with urllib.request.urlopen(request, timeout=self.settings.timeout_s) as response:
        raw = response.read()
    except urllib.error.HTTPError as e:
      e.close()
      if e.code in (408, 409, 429) or e.code >= 500:
        raise _Retryable(f"HTTP {e.code}") from None
      # Other client errors (bad key, bad model name) will not improve on retry.
      raise SimulatorBackendError(self._scrub(f"POST {self._path} failed: HTTP {e.code}")) from None
    except (TimeoutError, socket.timeout):
      raise _Retryable(f"timed out after {self.settings.timeout_s:g} s") from None
    except http.client.HTTPException as e:  # e.g. a truncated body
      raise _Retryable(f"bad HTTP response ({type(e).__name__})") from None
    except OSError as e:  # URLError, connection refused or reset
      reason = getattr(e, "reason", e)
      if isinstance(reason, (TimeoutError, socket.timeout)):
        raise _Retryable(f"timed out after {self.settings.timeout_s:g} s") from None
      raise _Retryable(f"connection error ({type(reason).__name__})") from None
    return _content(raw)

  def _scrub(self, message: str) -> str:
    key = os.environ.get(self.settings.api_key_env, "")
    return message.replace(key, "***") if key else message


def _on_process_zero(fetch: Callable[[], list]) -> list:
  """Runs `fetch` on process 0 only and hands its answers (or its failure) to every process.

  A sampled HTTP answer differs from call to call: if every host asked the server, hosts would
  parse different texts, append different token ids and run diverging collective programs.
  """
  if jax.process_count() == 1:
    return fetch()
  payload: dict = {}
  if jax.process_index() == 0:
    try:
      payload = {"answers": fetch()}
    except SimulatorBackendError as e:
      payload = {"error": str(e)}
    except Exception as e:  # every host must raise, or the others would wait in the next collective
      payload = {"error": f"{type(e).__name__}: {e}"}
  payload = json.loads(broadcast_bytes(json.dumps(payload).encode("utf-8")).decode("utf-8"))
  if "error" in payload:
    raise SimulatorBackendError(payload["error"])
  return payload["answers"]


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
