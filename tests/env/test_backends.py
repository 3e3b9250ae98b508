"""Tests of the simulator backends: scripted rules and the OpenAI-compatible HTTP client."""
import http.server
import json
import re
import socket
import threading
import time

import pytest

from rlver_jax.env import scripted_rules
import jax

from rlver_jax.env.backends import (OpenAIChatBackend, ScriptedBackend, SimRequest,
                                    SimulatorBackend, SimulatorBackendError, failure_context)
from rlver_jax.env.chat import says_goodbye
from rlver_jax.env.profiles import HIDDEN_INTENTIONS_EN, INTENTION_KEYS, Profile
from rlver_jax.env.parsing import parse_change

KEY_ENV = "RLVER_TEST_SIM_KEY"
SECRET = "sk-test-secret-0123456789"


def _profile(intention: str = "deep_empathy", main_cha: str = "negative") -> Profile:
  task = HIDDEN_INTENTIONS_EN[INTENTION_KEYS.index(intention)]
  return Profile(id=f"id-{intention}", player="Name: Sam", scene="story", main_cha=main_cha,
                 cha_group=("a", "b"), task=task)


def _req(row: int, kind: str = "emotion", reply: str | None = "hi", text: str = "msg",
         **kw) -> SimRequest:
  kw.setdefault("profile", _profile())
  kw.setdefault("language", "en")
  return SimRequest(row=row, new_messages=[{"role": "user", "content": text}], kind=kind,
                    policy_reply=reply, **kw)


# --- Scripted rules -----------------------------------------------------------------------------

@pytest.mark.parametrize("intention", INTENTION_KEYS)
def test_every_intention_rewards_its_own_phrases(intention):
  en, zh = scripted_rules.REWARDED[intention]
  for phrase in (en[0], zh[0]):
    score = scripted_rules.score_reply(f"Hmm. {phrase} 呀", intention)
    bonus = scripted_rules.SHORT_LISTEN_BONUS if score.short_bonus else 0
    assert score.hits == (phrase,) and score.change == scripted_rules.HIT_GAIN + bonus


def test_score_rules():
  score = scripted_rules.score_reply
  assert score("", "no_fault").change == -8
  assert score("   ", "no_fault").garbled
  assert score("?!?! ... ### 123", "no_fault").change == -8
  assert score("aaaaaaaa", "no_fault").change == -8
  assert score("Nice weather.", "no_fault").change == -2
  assert score("It's not your fault. Calm down.", "no_fault").change == 4 - 3
  assert score("Entry to the country", "actionable_advice").change == -2  # "try" only as a word
  assert score("Try it: step one, you could plan.", "actionable_advice").change == 10
  assert score("I'm listening, go on.", "listen_venting").change == 8 + 2
  assert score("I'm listening. You should try yoga.", "listen_venting").change == 4 - 6
  long_reply = "I hear you. " + "and so on " * 100
  assert score(long_reply, "deep_empathy").change == 4 - 3
  assert score("不是你的错，你没有错", "no_fault").change == 8
  assert score("I’m listening", "listen_venting").hits == ("i'm listening",)  # curly apostrophe


def test_analysis_text_round_trips_through_the_parser():
  for reply in ["", "I hear you", "That sounds hard and must feel lonely; I hear you", "Calm down"]:
    s = scripted_rules.score_reply(reply, "deep_empathy")
    for language in ("en", "zh"):
      text = scripted_rules.analysis_text(s, language)
      assert parse_change(text) == s.change
      assert len(text.splitlines()) == 5


def test_reply_templates_say_goodbye_only_at_s_and_f():
  for language in ("en", "zh"):
    for state in "SABCF":
      for key in ("a", "b", "c", "d"):
        text = scripted_rules.reply_text(state, language, key, passive=False)
        reply = text.split("Reply: " if language == "en" else "回复：")[-1]
        assert says_goodbye(reply, language) == (state in "SF"), (state, reply)
        passive = scripted_rules.reply_text(state, language, key, passive=True)
        assert "?" not in passive and "？" not in passive


def test_scripted_backend_is_deterministic_and_keeps_history():
  outs = []
  for _ in range(2):
    backend = ScriptedBackend()
    backend.reset(2)
    outs.append(backend.generate([_req(0, "opening", None), _req(1, "emotion", "I hear you")]))
    outs.append(backend.generate([_req(1, "reply", state="A", emotion=70)]))
  assert outs[0] == outs[2] and outs[1] == outs[3]
  assert outs[0][1].endswith("Change: +4")
  assert outs[1][0].startswith("Plan:") and "Reply:" in outs[1][0]
  assert [m["role"] for m in backend.history(1)] == ["user", "assistant", "user", "assistant"]
  assert backend.history(0)[1]["content"] == outs[2][0]


def test_scripted_backend_declares_the_optional_capabilities():
  backend = ScriptedBackend()
  assert isinstance(backend, SimulatorBackend)
  backend.reset(1)
  backend.reseed(jax.random.key(0))  # nothing to seed: deterministic rules
  assert not backend.is_full(0) and backend.take_counts() == {}
  assert backend.prefill_tokens is None and backend.last_error is None
  assert failure_context(backend) == "last error: None; server ScriptedBackend"


def test_history_validation():
  backend = ScriptedBackend()
  backend.reset(1)
  with pytest.raises(ValueError, match="once"):
    backend.generate([_req(0), _req(0)])
  with pytest.raises(IndexError):
    backend.generate([_req(3)])
  with pytest.raises(ValueError, match="kind"):
    _req(0, kind="chat")
  backend.generate([_req(0)])
  backend.reset(1)
  assert backend.history(0) == []


# --- HTTP backend against local stub servers ----------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
  def do_POST(self):  # noqa: N802 (http.server naming)
    server = self.server
    body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
    with server.lock:
      server.count += 1
      n = server.count
      server.inflight += 1
      server.max_inflight = max(server.max_inflight, server.inflight)
      server.seen.append({"path": self.path, "body": json.loads(body),
                          "auth": self.headers.get("Authorization")})
    done = False
    try:
      status, payload = server.respond(n, json.loads(body))
      if server.delay:
        time.sleep(server.delay)
      # Leave the in-flight count before answering: once the client has the answer it may send its
      # next request, which must not overlap this one in the count.
      with server.lock:
        server.inflight -= 1
      done = True
      data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
      pass  # the client gave up (timeout test)
    finally:
      if not done:
        with server.lock:
          server.inflight -= 1

  def log_message(self, *args):
    pass


def _ok(n, body):
  last = body["messages"][-1]["content"]
  return 200, {"choices": [{"message": {"role": "assistant", "content": f"echo {n}: {last}"}}]}


@pytest.fixture
def stub():
  servers = []

  def start(respond=_ok, delay=0.0):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.respond, server.delay = respond, delay
    server.lock, server.count, server.seen = threading.Lock(), 0, []
    server.inflight = server.max_inflight = 0
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                     daemon=True).start()
    servers.append(server)
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"

  yield start
  for server in servers:
    server.shutdown()
    server.server_close()


def _backend(url, **kw):
  kw.setdefault("api_key_env", KEY_ENV)
  kw.setdefault("backoff_s", 0.01)
  kw.setdefault("timeout_s", 2.0)
  return OpenAIChatBackend(url, "sim-model", **kw)


def _fails(backend) -> str:
  """One request that fails within its bound: None for it (its dialogue ends), no exception."""
  assert backend.generate([_req(0)]) == [None]
  assert backend.last_error and "\n" not in backend.last_error
  return backend.last_error


def test_http_request_body_and_auth(stub, monkeypatch):
  monkeypatch.setenv(KEY_ENV, SECRET)
  server, url = stub()
  backend = _backend(url, temperature=0.3, top_p=0.9, max_tokens=77)
  backend.reset(3)
  first = backend.generate([_req(r, text=f"hello {r}") for r in range(3)])
  assert [t.split(": ", 1)[1] for t in first] == ["hello 0", "hello 1", "hello 2"]
  second = backend.generate([_req(1, text="again")])
  assert second[0].endswith(": again")
  assert len(server.seen) == 4
  for seen in server.seen:
    assert seen["path"] == "/v1/chat/completions"
    assert seen["auth"] == f"Bearer {SECRET}"
    body = seen["body"]
    assert body["model"] == "sim-model"
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.3, 0.9, 77)
  # Stateless API: the second call for row 1 carries the row's whole conversation.
  assert server.seen[-1]["body"]["messages"] == [
      {"role": "user", "content": "hello 1"}, {"role": "assistant", "content": first[1]},
      {"role": "user", "content": "again"}]
  assert backend.history(1)[-1] == {"role": "assistant", "content": second[0]}
  assert SECRET not in repr(backend)


def test_http_no_key_no_header(stub, monkeypatch):
  monkeypatch.delenv(KEY_ENV, raising=False)
  server, url = stub()
  backend = _backend(url)
  backend.reset(1)
  backend.generate([_req(0)])
  assert server.seen[0]["auth"] is None


def test_http_concurrency_limit(stub):
  server, url = stub(delay=0.05)
  backend = _backend(url, max_concurrency=2)
  backend.reset(6)
  out = backend.generate([_req(r, text=str(r)) for r in range(6)])
  assert [t.split(": ", 1)[1] for t in out] == [str(r) for r in range(6)]
  assert server.max_inflight <= 2


def test_http_timeout_is_bounded(stub, monkeypatch):
  monkeypatch.setenv(KEY_ENV, SECRET)
  server, url = stub(delay=0.6)
  backend = _backend(url, timeout_s=0.2, max_attempts=2)
  backend.reset(1)
  message = _fails(backend)
  # Each attempt stopped at timeout_s (the server answers after 0.6 s), and only 2 were made.
  assert "/v1/chat/completions failed after 2 attempts: timed out after 0.2 s" in message, message
  assert SECRET not in message and "\n" not in message
  assert server.count == 2
  assert backend.history(0)[-1]["role"] == "user"  # nothing was appended for the failed call


@pytest.mark.parametrize("payload,problem", [
    (b"<html>not json</html>", "not valid JSON"),
    ({"choices": []}, "lacks choices[0].message.content"),
    ({"choices": [{"message": {"content": None}}]}, "not a string"),
])
def test_http_bad_body_is_retried_then_raises(stub, monkeypatch, payload, problem):
  monkeypatch.setenv(KEY_ENV, SECRET)
  server, url = stub(respond=lambda n, body: (200, payload))
  backend = _backend(url, max_attempts=3)
  backend.reset(1)
  message = _fails(backend)
  assert problem in message
  assert server.count == 3
  assert SECRET not in message
  assert backend.take_counts() == {"attempts": 3, "retries": 2, "failed_requests": 1}


def test_http_fails_once_then_succeeds(stub, monkeypatch):
  monkeypatch.setenv(KEY_ENV, SECRET)
  server, url = stub(respond=lambda n, body: (503, {"error": "busy"}) if n == 1 else _ok(n, body))
  backend = _backend(url, max_attempts=3)
  backend.reset(1)
  assert backend.generate([_req(0, text="x")]) == ["echo 2: x"]
  assert server.count == 2
  # The retried 500 shows in the step's metrics, not only in the server's log.
  assert backend.take_counts() == {"attempts": 2, "retries": 1, "failed_requests": 0}
  assert backend.take_counts() == {"attempts": 0, "retries": 0, "failed_requests": 0}  # per step


def test_http_client_error_is_not_retried(stub, monkeypatch):
  monkeypatch.setenv(KEY_ENV, SECRET)
  server, url = stub(respond=lambda n, body: (401, {"error": f"bad key {SECRET}"}))
  backend = _backend(url, max_attempts=3)
  backend.reset(1)
  message = _fails(backend)
  assert "HTTP 401" in message
  assert server.count == 1
  assert SECRET not in message


def test_http_failure_context_names_the_server_and_the_error(monkeypatch):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  backend = _backend(f"http://127.0.0.1:{port}/v1", max_attempts=1)
  assert isinstance(backend, SimulatorBackend)
  backend.reset(1)
  message = _fails(backend)
  assert failure_context(backend) == f"last error: {message}; server http://127.0.0.1:{port}/v1"
  assert backend.take_counts() == {"attempts": 1, "retries": 0, "failed_requests": 1}


def test_http_connection_refused(monkeypatch):
  monkeypatch.setenv(KEY_ENV, SECRET)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  backend = _backend(f"http://127.0.0.1:{port}/v1", max_attempts=2)
  backend.reset(1)
  message = _fails(backend)
  assert "connection error" in message and SECRET not in message


def _raw_server(handle):
  """A loopback TCP server whose connections `handle(conn)` answers by hand (not HTTP-conformant)."""
  srv = socket.socket()
  srv.bind(("127.0.0.1", 0))
  srv.listen(8)
  stop = threading.Event()

  def serve():
    srv.settimeout(0.1)
    while not stop.is_set():
      try:
        conn, _ = srv.accept()
      except (socket.timeout, OSError):
        continue
      threading.Thread(target=_handle_quietly, args=(handle, conn, stop), daemon=True).start()
  threading.Thread(target=serve, daemon=True).start()
  return f"http://127.0.0.1:{srv.getsockname()[1]}/v1", lambda: (stop.set(), srv.close())


def _handle_quietly(handle, conn, stop):
  try:
    conn.settimeout(5)
    conn.recv(65536)  # the request (small enough for one read here)
    handle(conn, stop)
  except OSError:
    pass
  finally:
    conn.close()


def test_http_garbage_answer_is_retried_then_fails_the_request():
  url, close = _raw_server(lambda conn, stop: conn.sendall(b"\x00\xffNOT HTTP AT ALL\r\n\r\n"))
  try:
    backend = _backend(url, max_attempts=2)
    backend.reset(1)
    assert "bad HTTP response" in _fails(backend)
    assert backend.take_counts() == {"attempts": 2, "retries": 1, "failed_requests": 1}
  finally:
    close()


def test_http_trickling_server_is_cut_by_the_deadline():
  def trickle(conn, stop):  # headers, then a byte every 50 ms: no single read ever times out
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    while not stop.is_set():
      conn.sendall(b" ")
      time.sleep(0.05)
  url, close = _raw_server(trickle)
  try:
    backend = _backend(url, timeout_s=1.0, deadline_s=0.5, max_attempts=2)
    backend.reset(1)
    t0 = time.monotonic()
    assert "within the 0.5 s deadline" in _fails(backend)
    assert time.monotonic() - t0 < 4.0  # 2 x 0.5 s plus back-off, not 100000 x 50 ms
  finally:
    close()


def test_http_hanging_server_fails_one_request_and_the_others_answer(stub):
  hang = threading.Event()
  server, url = stub(respond=lambda n, body: (hang.wait(3) and False) or _ok(n, body)
                     if body["messages"][-1]["content"] == "hang" else _ok(n, body))
  backend = _backend(url, timeout_s=0.3, max_attempts=1)
  backend.reset(2)
  out = backend.generate([_req(0, text="hang"), _req(1, text="fine")])
  hang.set()
  assert out[0] is None and out[1].endswith(": fine")
  assert "timed out after 0.3 s" in backend.last_error
  assert backend.history(1)[-1]["role"] == "assistant" and backend.history(0)[-1]["role"] == "user"
