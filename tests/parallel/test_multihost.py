"""Multi-host SPMD on one machine: `python -m rlver_jax.main` as 2 processes x 2 CPU devices over
loopback (gloo collectives) trains exactly like 1 process x 4 devices on the same mesh shape.

Every host builds the same global batch; only process 0 writes the run's files; orbax writes the
checkpoint from all hosts together; SIGTERM to one host stops all after the same step, with one
checkpoint of it. The HTTP simulator is asked by process 0 only.
"""
import http.server
import json
import pathlib
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import tiny_world
from compile_flags import tiny_run_env
from rlver_jax.run.outcomes import PREEMPTED_EXIT

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 900  # per run; generous because the CPUs may be shared, still ends a hang
# Per-step wall-clock numbers differ run to run.
TIMING = {"rollout_seconds", "update_seconds", "rollout_fraction", "rollout_policy_tokens_per_s",
          "update_tokens_per_s", "time/reshard"}
# Reduced over the mesh by the update's collectives: gloo (2 processes) and the in-process CPU
# all-reduce (1 process) sum in different orders, so these may differ in the last float32 bits.
REDUCED = {"loss", "pg_loss", "entropy", "grad_norm", "approx_kl", "clip_frac", "dual_clip_frac",
           "ratio_max", "ratio_mean", "ratio_min", "kl_loss"}


def _env() -> dict[str, str]:
  return tiny_run_env()  # the device count comes from --cpu_devices, as on a real host


def _start(args: list[str], log: pathlib.Path) -> subprocess.Popen:
  out = open(log, "w")
  return subprocess.Popen([sys.executable, *args], cwd=REPO, env=_env(), stdout=out,
                          stderr=subprocess.STDOUT, text=True)


def _launch(world, workdir: pathlib.Path, *, processes: int, devices: int, steps: int,
            logs: pathlib.Path, **overrides) -> list[subprocess.Popen]:
  extra = {"log.transcripts_every": 1, "checkpoint.keep": 100, **overrides}
  flags = tiny_world.cli_flags(world, "grpo", str(workdir), steps, **extra)
  flags.append(f"--cpu_devices={devices}")
  if processes > 1:
    from gcs_emulator import free_port
    flags += [f"--coordinator_address=127.0.0.1:{free_port()}", f"--num_processes={processes}"]
  return [_start(["-m", "rlver_jax.main", *flags]
                 + ([f"--process_id={i}"] if processes > 1 else []),
                 logs / f"{workdir.name}.{i}.log") for i in range(processes)]


def _kill_all(procs: list[subprocess.Popen]) -> None:
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


def _wait(procs: list[subprocess.Popen], logs: list[pathlib.Path], codes=None) -> None:
  """Waits for all; a hang or a failure (an exit status other than `codes[i]`, default 0) kills the
  rest and fails with the logs' tails."""
  deadline = time.time() + TIMEOUT_S
  try:
    for p in procs:
      p.wait(timeout=max(deadline - time.time(), 1))
  except subprocess.TimeoutExpired:
    pass
  _kill_all(procs)
  codes = codes or [0] * len(procs)
  bad = [(p, log) for p, log, code in zip(procs, logs, codes) if p.returncode != code]
  if bad:
    pytest.fail("\n\n".join(f"{log.name}: exit {p.returncode}\n{log.read_text()[-3000:]}"
                            for p, log in bad))


def _metrics(workdir: pathlib.Path) -> list[dict]:
  return [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]


def _last_step(workdir: pathlib.Path) -> int:
  """The last step in metrics.jsonl so far (0 before the first; the file is rewritten each step)."""
  try:
    return _metrics(workdir)[-1]["step"]
  except (OSError, ValueError, IndexError, KeyError):
    return 0


def _wait_for_step(workdir: pathlib.Path, step: int, procs: list[subprocess.Popen],
                   logs: list[pathlib.Path]) -> None:
  deadline = time.time() + TIMEOUT_S
  while _last_step(workdir) < step:
    if time.time() > deadline or any(p.poll() is not None for p in procs):
      _kill_all(procs)
      pytest.fail(f"no step {step} in {workdir}/metrics.jsonl:\n"
                  + "\n".join(log.read_text()[-2000:] for log in logs))
    time.sleep(0.5)


def _state(workdir: pathlib.Path, step: int) -> dict:
  """The checkpoint's arrays as host numpy, whatever devices wrote them."""
  path = workdir / "checkpoints" / str(step) / "state"
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path).item_metadata.tree
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))


def test_two_hosts_train_like_one_and_stop_together(tmp_path):
  world = tiny_world.make_world(tmp_path / "world")
  multi, single = tmp_path / "multi", tmp_path / "single"
  # Both runs at once: the two hosts of one wait on each other's collectives anyway. The two-host
  # run is long (checkpoints every 2 steps) and is stopped by SIGTERM to process 1 alone.
  procs = (_launch(world, multi, processes=2, devices=2, steps=1000, logs=tmp_path)
           + _launch(world, single, processes=1, devices=4, steps=2, logs=tmp_path))
  logs = [tmp_path / f"multi.{i}.log" for i in range(2)] + [tmp_path / "single.0.log"]
  _wait_for_step(multi, 2, procs[:2], logs[:2])
  procs[1].send_signal(signal.SIGTERM)
  _wait(procs, logs, codes=[PREEMPTED_EXIT, PREEMPTED_EXIT, 0])  # both hosts exit as preempted

  # Both hosts stopped after the same step and saved it together, exactly once.
  a, b = _metrics(multi), _metrics(single)
  stop = a[-1]["step"]
  assert [m["step"] for m in a] == list(range(1, stop + 1)) and stop < 1000
  assert [m["step"] for m in b] == [1, 2]
  for log in logs[:2]:
    assert f"saved step {stop}, exiting" in log.read_text()  # after a step or mid-rollout
  steps = sorted(int(d.name) for d in (multi / "checkpoints").iterdir() if d.name.isdigit())
  assert steps == sorted({*range(2, stop + 1, 2), stop})
  meta = json.loads((multi / "checkpoints" / str(stop) / "meta" / "metadata").read_text())
  assert meta["step"] == stop
  _state(multi, stop)  # restorable

  _assert_same_metrics(a, b)

  # Only process 0 writes the run's files; its summary is the only one printed.
  for name in ("step_000001.jsonl", "step_000002.jsonl"):
    assert (multi / "transcripts" / name).read_text() == (single / "transcripts" / name).read_text()
  assert len(list((multi / "tensorboard").iterdir())) == 1
  assert (multi / "reward.png").exists() and (multi / "config.json").exists()
  assert f"run preempted at step {stop}" in logs[0].read_text()
  assert f"preempted at step {stop} of 1000; run the same command to resume" in logs[0].read_text()
  assert "run preempted" not in logs[1].read_text()
  _assert_same_state(_state(multi, 2), _state(single, 2))


def _assert_same_metrics(a: list[dict], b: list[dict]) -> None:
  for ma, mb in zip(a, b):
    assert set(ma) == set(mb)
    # mismatch/* are float-noise statistics of log-prob differences (~1e-14): compared within tolerance.
    noise = {k for k in ma if k.startswith("mismatch/")}
    for k in noise:
      assert abs(ma[k] - mb[k]) < 1e-5, k
    exact = {k: v for k, v in ma.items() if k not in TIMING | REDUCED | noise}
    assert exact == {k: mb[k] for k in exact}  # rewards, turns, token counts: bit for bit
    for k in set(ma) & REDUCED:
      np.testing.assert_allclose(ma[k], mb[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_two_hosts_train_with_a_layout_per_model_like_one(tmp_path):
  """Training FSDP over 4 devices, the policy's rollout copy tensor parallel (2x1x2, resharded after
  each update across both hosts) and the co-located simulator in a third layout (1x2x2)."""
  world = tiny_world.make_world(tmp_path / "world", num_heads=4, num_kv_heads=2)
  layouts = {"rollout.policy_mesh": "2x1x2", "simulator.mesh": "1x2x2",
             "simulator.backend": "model", "simulator.checkpoint": world["policy"],
             "simulator.max_new_tokens": 6, "simulator.max_context": 2048,
             "simulator.dtype": "float32"}
  multi, single = tmp_path / "multi", tmp_path / "single"
  procs = (_launch(world, multi, processes=2, devices=2, steps=2, logs=tmp_path, **layouts)
           + _launch(world, single, processes=1, devices=4, steps=2, logs=tmp_path, **layouts))
  logs = [tmp_path / f"multi.{i}.log" for i in range(2)] + [tmp_path / "single.0.log"]
  _wait(procs, logs)
  a, b = _metrics(multi), _metrics(single)
  assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
  assert all(m["reshard/bytes"] > 0 for m in a)
  _assert_same_metrics(a, b)
  for workdir in (multi, single):
    start = json.loads((workdir / "provenance.json").read_text())[0]
    assert start["layouts"] == {"train": "data=1 fsdp=4 tensor=1",
                                "policy_rollout": "data=2 fsdp=1 tensor=2 (2x1x2)",
                                "simulator": "data=1 fsdp=2 tensor=2 (1x2x2)"}, start["layouts"]


def _exits(procs: list[subprocess.Popen], logs: list[pathlib.Path]) -> list[tuple[int, str]]:
  """Waits for every process; (exit code, last non-blank line of its log) of each."""
  for p in procs:
    p.wait(timeout=TIMEOUT_S)
  return [(p.returncode, [l for l in log.read_text().splitlines() if l.strip()][-1])
          for p, log in zip(procs, logs)]


def _two_hosts(tmp_path: pathlib.Path, name: str, flags_of) -> list[tuple[int, str]]:
  """`python -m rlver_jax.main` as 2 processes x 1 device, process i with flags `flags_of(i)`;
  returns `_exits` of both."""
  from gcs_emulator import free_port
  port = free_port()
  procs, logs = [], []
  for i in range(2):
    flags = flags_of(i) + ["--cpu_devices=1", f"--coordinator_address=127.0.0.1:{port}",
                           "--num_processes=2", f"--process_id={i}"]
    logs.append(tmp_path / f"{name}{i}.log")
    procs.append(_start(["-m", "rlver_jax.main", *flags], logs[-1]))
  return _exits(procs, logs)


def test_a_workdir_not_shared_by_the_hosts_is_refused(tmp_path):
  # Two hosts that each see their own disk at the workdir path (simulated: two different paths).
  world = tiny_world.make_world(tmp_path / "world")
  exits = _two_hosts(tmp_path, "disk", lambda i: tiny_world.cli_flags(
      world, "grpo", str(tmp_path / f"disk{i}" / "run"), 1))
  for code, last in exits:
    assert code != 0 and last.startswith("error: ") and "is not shared by all 2 processes" in last
    assert "processes [1]" in last, last
  assert not list(tmp_path.glob("disk*/run/config.json"))
  assert not list(tmp_path.glob("disk*/run/.shared-check-*"))


def test_an_input_missing_on_one_host_is_refused_by_all(tmp_path):
  # Process 1 does not see the profiles file (its own disk; simulated with another path). It used
  # to fail alone while loading them and leave process 0 waiting in the policy's loading.
  world = tiny_world.make_world(tmp_path / "world")
  elsewhere = [f"--config.data.profiles={tmp_path}/elsewhere/profiles.jsonl"]
  exits = _two_hosts(tmp_path, "input", lambda i: tiny_world.cli_flags(
      world, "grpo", str(tmp_path / "run"), 1) + (elsewhere if i == 1 else []))
  for code, last in exits:
    assert code == 1 and last.startswith("error: config.data.profiles: "), last
    assert "is not seen by processes [1] of 2" in last, last
  assert not (tmp_path / "run" / "config.json").exists()


def test_a_write_failing_on_process_0_stops_every_host_at_once(tmp_path):
  # Process 0 cannot write metrics.jsonl (its temp file's name is taken by a directory). The other
  # host used to wait in the next collective until the coordination service aborted both, ~5 min
  # later, with a "shutdown barrier" error and no word of the cause.
  world = tiny_world.make_world(tmp_path / "world")
  workdir = tmp_path / "run"
  (workdir / "metrics.jsonl.tmp").mkdir(parents=True)
  procs = _launch(world, workdir, processes=2, devices=1, steps=3, logs=tmp_path)
  exits = _exits(procs, [tmp_path / f"run.{i}.log" for i in range(2)])
  last = [line for _, line in exits]
  assert [code for code, _ in exits] == [1, 1], last
  # Process 0 names the file, the step and what is kept; process 1 says process 0 failed, and why.
  assert last[0].startswith(f"error: could not write the row of step 1 to {workdir}/metrics.jsonl "
                            "(Is a directory); the file is unchanged"), last[0]
  assert last[1].startswith(f"error: process 0 failed writing {workdir}/metrics.jsonl: "), last[1]
  assert "Is a directory" in last[1], last[1]


_EXPORT_WORKER = r"""
import sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
import jax.numpy as jnp
from rlver_jax.models import create_model, export_pretrained
from rlver_jax.models.io import safetensors as safetensors_io
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.parallel.process_zero import ProcessZeroError
from rlver_jax.parallel.sharding import MeshConfig, make_mesh

cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=16, tie_word_embeddings=True, qkv_bias=True,
                  eos_token_id=1, pad_token_id=0)
model = create_model(cfg, mesh=make_mesh(MeshConfig(fsdp=2)), dtype=jnp.float32, seed=0)
from rlver_jax.models.io import hf as hf_io
if jax.process_index() == 0 and sys.argv[4] == "write":  # the disk fills up in the second shard
  write_file, calls = safetensors_io.write_file, []
  def failing(path, entries, arrays):
    calls.append(path)
    if len(calls) == 2:
      next(iter(arrays))
      raise OSError(28, "No space left on device", path)
    return write_file(path, entries, arrays)
  safetensors_io.write_file = failing
if jax.process_index() == 0 and sys.argv[4] == "convert":  # the fifth tensor fails
  to_hf, converted = hf_io._Mapping.to_hf, []
  def failing(self, x):
    converted.append(1)
    if len(converted) == 5:
      raise MemoryError("no room for the converted tensor")
    return to_hf(self, x)
  hf_io._Mapping.to_hf = failing
try:
  export_pretrained(model, cfg, sys.argv[3], max_shard_bytes=20_000)
  print("RESULT exported", flush=True)
except (OSError, MemoryError, ProcessZeroError) as e:
  print(f"RESULT {type(e).__name__}: {e}", flush=True)
"""


@pytest.mark.parametrize("failing", ["write", "convert"])
def test_an_export_failing_on_process_0_mid_shard_stops_every_host(tmp_path, failing):
  # Process 0 writes while every process joins each tensor's gather: a write (or a tensor's
  # conversion) that fails part-way must still take part in the gathers the others run for the
  # rest of its shard.
  from gcs_emulator import free_port
  coordinator = f"127.0.0.1:{free_port()}"
  out = tmp_path / "hf"
  logs = [tmp_path / f"export.{i}.log" for i in range(2)]
  procs = [_start(["-c", _EXPORT_WORKER, coordinator, str(i), str(out), failing], logs[i])
           for i in range(2)]
  _wait(procs, logs)
  results = [l.split("RESULT ", 1)[1] for log in logs for l in log.read_text().splitlines()
             if l.startswith("RESULT ")]
  written = sorted(p.name for p in out.glob("model-*.safetensors"))
  assert len(written) == 1 and written[0].startswith("model-00001-of-"), written
  # The write fails as the second shard starts; the conversion at the first shard's fifth tensor.
  shard = out / (written[0].replace("model-00001-", "model-00002-") if failing == "write" else written[0])
  error = (f"OSError: [Errno 28] No space left on device: '{shard}'" if failing == "write"
           else "MemoryError: no room for the converted tensor")
  assert results == [error, f"ProcessZeroError: process 0 failed writing {shard}: {error}"], results


def _leaves(tree) -> list[tuple[str, np.ndarray]]:
  return [(jax.tree_util.keystr(k), x) for k, x in jax.tree_util.tree_leaves_with_path(tree)]


def _assert_same_state(a: dict, b: dict) -> None:
  """Params, optimizer state and RNG agree up to the all-reduce order (see REDUCED).

  Adam divides by sqrt(nu) + 1e-8: where a parameter's gradient is rounding noise (sqrt(nu) below
  that eps, e.g. the key bias on the lowest RoPE frequency), its step is noise too, so those
  coordinates are left out; everywhere else the runs agree to ~1e-6 (atol 1e-5 below).
  """
  leaves_a, leaves_b = _leaves(a), _leaves(b)
  assert [k for k, _ in leaves_a] == [k for k, _ in leaves_b]
  nu = [x for k, x in _leaves(b["policy_opt"]) if "['nu']" in k]
  assert len(nu) == len(_leaves(b["policy"]))
  live = dict(zip([k for k, _ in _leaves({"policy": b["policy"]})], [np.sqrt(v) > 1e-8 for v in nu]))
  for (key, x), (_, y) in zip(leaves_a, leaves_b):
    if not np.issubdtype(x.dtype, np.floating):
      np.testing.assert_array_equal(x, y, err_msg=key)
      continue
    mask = live.get(key, np.ones(x.shape, bool))
    assert mask.mean() > 0.5, key  # the noise coordinates are few
    np.testing.assert_allclose(x[mask], y[mask], rtol=0, atol=1e-5, err_msg=key)


_HTTP_WORKER = r"""
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from rlver_jax.env.backends import OpenAIChatBackend, SimRequest
from rlver_jax.env.profiles import Profile

profile = Profile("p", "Sam", "a shop", "negative", ("tired",), "task")
backend = OpenAIChatBackend(sys.argv[3], "sim", max_attempts=1, timeout_s=30)
backend.reset(2)
ask = lambda: [SimRequest(r, ({"role": "user", "content": f"hi {r}"},), "reply", profile, "en")
               for r in range(2)]
out = {"texts": backend.generate(ask())}
# The server now answers 400: every host gets the same failed rows (None), none may hang.
out["failed"] = backend.generate(ask())
print("RESULT " + json.dumps(out), flush=True)
print("ERROR " + str(backend.last_error), flush=True)  # only process 0 talked to the server
"""


class _Sampling(http.server.BaseHTTPRequestHandler):
  """An OpenAI-style server whose answers differ per call, like a sampling LLM; then it fails."""
  calls = 0
  lock = threading.Lock()

  def do_POST(self):
    self.rfile.read(int(self.headers["Content-Length"]))
    with _Sampling.lock:
      _Sampling.calls += 1
      n = _Sampling.calls
    if n > 2:
      self.send_response(400)
      self.end_headers()
      return
    body = json.dumps({"choices": [{"message": {"content": f"answer {n}"}}]}).encode()
    self.send_response(200)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def log_message(self, *args):
    pass


def test_http_simulator_is_asked_once_for_all_hosts(tmp_path):
  from gcs_emulator import free_port
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sampling)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    coordinator = f"127.0.0.1:{free_port()}"
    logs = [tmp_path / f"http.{i}.log" for i in range(2)]
    procs = [_start(["-c", _HTTP_WORKER, coordinator, str(i), url], logs[i]) for i in range(2)]
    _wait(procs, logs)
  finally:
    server.shutdown()
  results = [json.loads(l.split("RESULT ", 1)[1]) for log in logs
             for l in log.read_text().splitlines() if l.startswith("RESULT ")]
  assert len(results) == 2 and results[0] == results[1], results
  assert sorted(results[0]["texts"]) == ["answer 1", "answer 2"]  # process 0's two calls only
  assert results[0]["failed"] == [None, None]  # each failed row ends its dialogue, on every host
  assert "HTTP 400" in logs[0].read_text().split("ERROR ", 1)[1]
  # Two rows per call, all from process 0 (process 1 asking too would make it 8).
  assert _Sampling.calls == 4, _Sampling.calls
