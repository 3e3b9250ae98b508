"""Simulator faults degrade a dialogue, not the run: a request that fails within its attempts ends
that dialogue as simulator_error (no reward, no loss weight, out of the group statistics) while the
others go on; too large a share of them stops the run after saving the last step; retries and
failures show in the step's metrics. Fake servers are on loopback only."""
import http.server
import json
import threading

import jax
import numpy as np
import pytest

import tiny_world
from rlver_jax.train import loop as train
from rlver_jax.spec import RunSpec
from rlver_jax import build
from rlver_jax.run.checkpoint import Checkpointer
from rlver_jax.env import backends
from rlver_jax.env.backends import ScriptedBackend
from rlver_jax.env.profiles import HIDDEN_INTENTIONS_EN, Profile
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.env.user_state import SIMULATOR_ERROR


def _profile(i):
  return Profile(id=f"p{i}", player=f"Name: P{i}", scene="A falling-out with a colleague.",
                 main_cha="negative", cha_group=("touchy",), task=HIDDEN_INTENTIONS_EN[0])


class _Failing(ScriptedBackend):
  """The scripted simulator, except that rows in `fail_rows` get None (a failed request) from their
  `after`-th request on; every row fails once `all_from_call` generate calls were made."""

  def __init__(self, fail_rows=(), after=1, all_from_call=None):
    super().__init__()
    self.fail_rows, self.after, self.all_from_call = set(fail_rows), after, all_from_call
    self.calls, self.last_error = 0, None

  def server(self):
    return "http://fake-simulator:1/v1"

  def reset(self, num_rows):
    super().reset(num_rows)
    self.asked = [0] * num_rows

  def generate(self, requests):
    self.calls += 1
    out = super().generate(requests)
    for i, r in enumerate(requests):
      self.asked[r.row] += 1
      everyone = self.all_from_call is not None and self.calls >= self.all_from_call
      if everyone or (r.row in self.fail_rows and self.asked[r.row] > self.after):
        out[i], self.last_error = None, "POST /v1/chat/completions failed after 4 attempts: HTTP 503"
    return out


def test_a_failed_request_ends_only_its_dialogue():
  users = SimulatedUsers([_profile(i) for i in range(3)], _Failing(fail_rows=[1], after=1), max_turns=3)
  users.opening()
  results = users.step([0, 1, 2], ["I hear you.", "I hear you.", "I hear you."])
  assert users.records[1].termination == SIMULATOR_ERROR and results[1].done
  assert results[1].user_reply is None and users.records[1].silent_replies == 0
  assert not results[0].done and not results[2].done  # the others go on
  users.step([0, 2], ["That sounds hard.", "That sounds hard."])
  assert len(users.records[1].emotions) == 2  # one entry per policy turn, as for every dialogue


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


def test_simulator_error_dialogues_get_no_weight_and_leave_the_group_statistics(world, tmp_path,
                                                                                monkeypatch):
  fake = _Failing(fail_rows=[0, 9], after=1)  # one dialogue in each of the two GRPO groups of 8
  monkeypatch.setattr(build, "simulator_backend", lambda *args, **kwargs: fake)
  trainer = tiny_world.trainer(tiny_world.training_config(world, "grpo", total_steps=1), str(tmp_path))
  rng = jax.random.fold_in(jax.random.wrap_key_data(trainer.state.rng), 0)
  with jax.set_mesh(trainer.mesh):
    dialogues, _ = trainer.rollout(rng)
  failed = [d for d in dialogues if d.termination == SIMULATOR_ERROR]
  assert [d.row for d in failed] == [0, 9] and all(not d.samples and d.reward == 0 for d in failed)
  trained = trainer._without_simulator_errors(dialogues)
  with jax.set_mesh(trainer.mesh):
    batch, _ = trainer.make_batch(trained)
  # Reference: GRPO by hand over the 7 remaining dialogues of each group.
  adv = np.asarray(batch.advantages).reshape(-1, batch.advantages.shape[-1])
  mask = np.asarray(batch.loss_mask).reshape(adv.shape)
  seg = np.asarray(batch.segment_ids).reshape(adv.shape)  # sample k (the step's order): id k + 1
  k = 0
  for d in trained:
    mates = np.array([e.reward for e in trained if e.group_id == d.group_id])
    want = (d.reward - mates.mean()) / (mates.std(ddof=1) + 1e-6) if mates.std() > 0 else 0.0
    for _ in d.samples:
      k += 1
      got = adv[(seg == k) & (mask > 0)]
      assert got.size > 0
      np.testing.assert_allclose(got, np.full_like(got, want), atol=1e-4)
  assert k == seg.max()  # every sample checked
  trainer.checkpointer.close()


def test_a_step_run_with_some_simulator_errors_reports_them(world, tmp_path, monkeypatch):
  fake = _Failing(fail_rows=[3], after=1)
  monkeypatch.setattr(build, "simulator_backend", lambda *args, **kwargs: fake)
  train.run(RunSpec.from_config(tiny_world.training_config(world, "grpo", total_steps=1)), str(tmp_path))
  row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  assert row["simulator/error_dialogues"] == 1 and row["termination/simulator_error"] == 1 / 16


def test_too_many_simulator_errors_stop_the_run_after_saving(world, tmp_path, monkeypatch):
  calls_per_step = _calls_per_step(world, tmp_path / "probe", monkeypatch)
  fake = _Failing(all_from_call=calls_per_step + 1)  # step 2's first request on, every one fails
  monkeypatch.setattr(build, "simulator_backend", lambda *args, **kwargs: fake)
  cfg = tiny_world.training_config(world, "grpo", total_steps=3, **{"checkpoint.every_steps": 100})
  with pytest.raises(train.TooManySimulatorErrors) as e:
    train.run(RunSpec.from_config(cfg), str(tmp_path / "run"))
  message = str(e.value)
  assert "step 2: 16 of 16 dialogues (100%) ended with simulator_error" in message
  assert "simulator.max_failed_share=0.5" in message and "HTTP 503" in message
  assert "http://fake-simulator:1/v1" in message and "\n" not in message
  ckpt = Checkpointer(str(tmp_path / "run"), every_steps=100, keep=3)
  assert ckpt.all_steps() == [1]  # step 1 was saved although every_steps would not have
  ckpt.close()


def _calls_per_step(world, workdir, monkeypatch):
  probe = _Failing()
  monkeypatch.setattr(build, "simulator_backend", lambda *args, **kwargs: probe)
  train.run(RunSpec.from_config(tiny_world.training_config(world, "grpo", total_steps=1)), str(workdir))
  return probe.calls


class _NonsenseServer(http.server.BaseHTTPRequestHandler):
  """Valid chat answers without a change or reply line; every third request is a 500 first."""

  def do_POST(self):  # noqa: N802
    self.rfile.read(int(self.headers.get("Content-Length", 0)))
    with self.server.lock:
      self.server.count += 1
      n = self.server.count
    if n % 3 == 0:
      self.send_response(500)
      self.send_header("Content-Length", "0")
      self.end_headers()
      return
    data = json.dumps({"choices": [{"message": {"content": "Hmm, the weather is nice."}}]}).encode()
    self.send_response(200)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def log_message(self, *args):
    pass


def test_a_nonsense_http_simulator_shows_in_the_metrics(world, tmp_path):
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NonsenseServer)
  server.daemon_threads, server.lock, server.count = True, threading.Lock(), 0
  threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
  try:
    cfg = tiny_world.training_config(world, "grpo", total_steps=1, **{
        "simulator.backend": "http", "simulator.http_model": "m", "simulator.top_k": 0,
        "simulator.http_base_url": f"http://127.0.0.1:{server.server_address[1]}/v1",
        "simulator.max_parse_retries": 0})
    monkey_backoff = backends.HttpSettings.__dataclass_fields__["backoff_s"]
    old = monkey_backoff.default
    monkey_backoff.default = 0.01  # no 1 s back-off per retried 500 in a test
    try:
      train.run(RunSpec.from_config(cfg), str(tmp_path))
    finally:
      monkey_backoff.default = old
  finally:
    server.shutdown()
    server.server_close()
  row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  # Constant reward (nothing to learn from): the parse and silence counts show why.
  assert row["reward_std"] == 0 and row["parse_failures"] > 0 and row["silent_replies"] > 0
  # The 500s were retried (and succeeded): they show as retries, not as failures.
  assert row["simulator/http_retries"] > 0 and row["simulator/http_failed_requests"] == 0
  assert row["simulator/http_attempts"] == server.count and row["simulator/error_dialogues"] == 0


def test_an_evaluation_stops_on_a_failed_request_instead_of_scoring_it():
  from types import SimpleNamespace
  from rlver_jax.env.backends import SimulatorBackendError
  from rlver_jax.evaluation.scoring import check_no_simulator_errors
  fake = _Failing()
  fake.last_error = "POST /v1/chat/completions failed after 4 attempts: HTTP 503"
  ok, lost = SimpleNamespace(termination="goodbye"), SimpleNamespace(termination=SIMULATOR_ERROR)
  check_no_simulator_errors([ok, ok], fake, "evaluation")
  with pytest.raises(SimulatorBackendError, match=r"evaluation: 1 of 2 dialogues lost their "
                     r"simulator \(last error: .*HTTP 503; server http://fake-simulator:1/v1\)"):
    check_no_simulator_errors([ok, lost], fake, "evaluation")
