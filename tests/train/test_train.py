"""The trainer: GRPO and PPO learn against the scripted simulator, resume equals a straight run,
SIGTERM leaves a restorable checkpoint, and bad inputs fail with one clear line."""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import tiny_world
from rlver_jax.rl.pack import pack
from rlver_jax.train import loop as train
from rlver_jax.spec import RunSpec
from rlver_jax.train import trainer as trainer_module
from rlver_jax.run.checkpoint import Checkpointer
from rlver_jax.run.outcomes import PREEMPTED_EXIT

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


_config = tiny_world.training_config


def _metrics(workdir):
  return [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo,steps", [("grpo", 12), ("ppo", 12)])
def test_policy_learns_against_scripted_simulator(world, tmp_path, algo, steps):
  config = _config(world, algo, total_steps=steps)
  train.run(RunSpec.from_config(config), str(tmp_path))
  rewards = [m["reward_mean"] for m in _metrics(tmp_path)]
  assert len(rewards) == steps
  early, late = np.mean(rewards[:3]), np.mean(rewards[-3:])
  # The scripted user rewards "try"/"step"/"plan": the policy must find and repeat them.
  assert late > early + 0.05, rewards


def test_micro_batch_size_counts_rows_per_batch_shard(world, tmp_path):
  """On 8 devices (fsdp=8) a micro-batch has micro_batch_size rows on each device, 8x that in all."""
  config = _config(world, "grpo", total_steps=1, **{"rl.micro_batch_size": 2,
                                                     "rl.pack_update": False})  # a sample a row
  trainer = tiny_world.trainer(config, str(tmp_path))
  with jax.set_mesh(trainer.mesh):
    dialogues, _ = trainer.rollout(jax.random.key(0))
    batch, extra = trainer.make_batch(dialogues)
  assert trainer.mesh.shape["fsdp"] == len(jax.devices()) == 8
  M, B, _ = batch.tokens.shape
  assert B == 2 * 8 and (M - 1) * B < extra["samples"] <= M * B
  assert {s.data.shape[1] for s in batch.tokens.addressable_shards} == {2}


def _params(workdir, config):
  trainer = tiny_world.trainer(config, str(workdir))
  assert trainer.restore_if_any()
  return jax.tree.map(np.asarray, trainer.state), trainer.step


@pytest.mark.parametrize("algo,simulator", [("grpo", "scripted"), ("grpo", "model"), ("ppo", "scripted"),
                                            ("grpo", "model-rows")])
def test_resume_equals_straight_run(world, tmp_path, algo, simulator):
  # With a sampling simulator (the tiny policy plays the user) its random draws must repeat too;
  # PPO restores a critic and its optimizer as well. "model-rows": continuous batching, the 16
  # dialogues of a step on 8 cache rows of each sampler (rollout.rows).
  sim = {} if simulator == "scripted" else {
      "simulator.backend": "model", "simulator.checkpoint": world["policy"],
      "simulator.max_new_tokens": 6, "simulator.max_context": 2048, "simulator.dtype": "float32"}
  if simulator == "model-rows":
    sim["rollout.rows"] = 8
  # Both schedules must resume mid-warm-up.
  warmup = {"optim.warmup_steps": 3, "optim.critic_warmup_steps": 3} if algo == "ppo" else {}
  cfg = lambda steps: _config(world, algo, total_steps=steps, **sim, **warmup, **{"log.transcripts_every": 1})
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  train.run(RunSpec.from_config(cfg(4)), str(straight))
  train.run(RunSpec.from_config(cfg(2)), str(resumed))
  train.run(RunSpec.from_config(cfg(4)), str(resumed))  # same command, longer run
  a, step_a = _params(straight, cfg(4))
  b, step_b = _params(resumed, cfg(4))
  assert step_a == step_b == 4
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)  # CPU XLA is deterministic: bitwise equal
  assert [m["reward_mean"] for m in _metrics(straight)] == [m["reward_mean"] for m in _metrics(resumed)]
  for step in (3, 4):  # the dialogues after the resume, simulated user lines included
    name = f"transcripts/step_{step:06d}.jsonl"
    assert (straight / name).read_text() == (resumed / name).read_text()


def test_config_conflict_on_resume_is_refused(world, tmp_path):
  train.run(RunSpec.from_config(_config(world, "grpo", total_steps=1)), str(tmp_path))
  before = (tmp_path / "config.json").read_text()
  with pytest.raises(ValueError, match=r"config\.rl\.clip_low"):
    changed = _config(world, "grpo", total_steps=2, **{"rl.clip_low": 0.3})
    train.run(RunSpec.from_config(changed), str(tmp_path))
  assert (tmp_path / "config.json").read_text() == before


def test_a_failed_start_leaves_the_workdir_usable(world, tmp_path):
  bad = _config(world, "grpo", total_steps=1, **{"data.profiles": world["profiles"] + ".typo"})
  with pytest.raises(ValueError, match=r"config\.data\.profiles"):
    tiny_world.trainer(bad, str(tmp_path))
  assert not (tmp_path / "config.json").exists()
  tiny_world.trainer(_config(world, "grpo", total_steps=1), str(tmp_path))  # the corrected command runs
  assert (tmp_path / "config.json").exists()


@pytest.mark.parametrize("key,value,algo,extra", [
    ("rl.loss_agg", "token_mean", "grpo", {}), ("rl.kl_kind", "k4", "grpo", {}),
    ("rl.mini_batches", 0, "grpo", {}), ("rl.epochs", 0, "grpo", {}),
    ("rl.mini_batches", 4, "grpo", {}),  # ignored while rl.mini_batch_rows counts rows
    ("rl.micro_batch_size", 0, "grpo", {}), ("eval.max_turns", 0, "grpo", {}),
    ("eval.temperature", -1.0, "grpo", {}), ("data.num_holdout", 0, "grpo", {}),
    ("simulator.style", "grumpy", "grpo", {}), ("simulator.start_emotion", 120, "grpo", {}),
    ("rl.reward_mode", "per-turn", "ppo", {}), ("rl.logits_chunk", 0, "grpo", {}),
    ("rl.gamma", 1.5, "ppo", {}), ("rl.gamma", 0.99, "ppo", {"policy.think": True}),
    ("rl.lam", -0.1, "ppo", {}), ("rl.clip_low", 1.5, "grpo", {}),
    ("rl.value_clip", -0.5, "ppo", {}), ("rl.format_penalty", True, "grpo", {}),
    ("optim.actor_lr", -1e-6, "grpo", {}), ("optim.grad_clip", -1.0, "grpo", {}),
    ("optim.b2", 1.0, "grpo", {}), ("policy.language", "fr", "grpo", {}),
    ("simulator.top_k", 20, "grpo", {"simulator.backend": "http", "simulator.http_model": "m",
                                     "simulator.http_base_url": "http://127.0.0.1:9/v1"})])
def test_settings_used_late_are_checked_at_start(world, tmp_path, key, value, algo, extra):
  # These used to fail at the first update, rollout or evaluation, leaving a config.json that then
  # refused the corrected command; others (rl.epochs=0, a negative grad_clip or learning rate,
  # format_penalty without think, top_k over HTTP) changed training without a word.
  evaluating = {"eval.every_steps": 1, "data.num_holdout": 1, "eval.num_profiles": 0}
  bad = _config(world, algo, total_steps=1, **{**evaluating, **extra, key: value})
  with pytest.raises(ValueError, match=re.escape(f"config.{key}=")):
    tiny_world.trainer(bad, str(tmp_path))
  assert not (tmp_path / "config.json").exists()


def test_an_unreadable_config_json_is_named_and_kept(world, tmp_path):
  for text, problem in [('{"algo": "grpo", ', "not valid JSON"), ("[1, 2]", "JSON list")]:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "config.json")) + ".*" + problem):
      tiny_world.trainer(_config(world, "grpo", total_steps=1), str(tmp_path))
    assert (tmp_path / "config.json").read_text() == text


def _update_counts(opt_state) -> set[int]:
  """Every `count` in an optax state: how many updates it has taken."""
  leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
  return {int(v) for path, v in leaves if "count" in jax.tree_util.keystr(path)}


def test_padding_only_mini_batches_take_no_optimizer_step(world, tmp_path):
  # 2 PPO samples in 2 mini-batches of 16-row micro-batches (2 rows x 8 shards): the second holds
  # padding only. An AdamW step on its zero gradient would still move every weight.
  config = _config(world, "ppo", total_steps=1, **{"rl.profiles_per_step": 2, "rl.micro_batch_size": 2,
                                                     "rl.mini_batches": 2, "rl.mini_batch_rows": 0})
  trainer = tiny_world.trainer(config, str(tmp_path))
  metrics = trainer.train_step().metrics
  assert metrics["samples"] == 2
  assert _update_counts(trainer.state.policy_opt) == {1}
  assert _update_counts(trainer.state.critic_opt) == {1}


def test_a_diverged_update_stops_before_it_is_saved():
  train.check_finite_update(3, {"loss": 0.5, "grad_norm": 2.0, "critic/loss": 1.0}, 2)
  for key in ("loss", "grad_norm", "critic/loss", "critic/grad_norm"):
    with pytest.raises(train.TrainingDiverged, match=f"step 3: {key}=nan .*checkpoint holds step 2"):
      train.check_finite_update(3, {"loss": 0.5, "grad_norm": 1.0, key: float("nan")}, 2)
  with pytest.raises(train.TrainingDiverged, match="grad_norm=inf .*holds nothing yet"):
    train.check_finite_update(1, {"loss": 0.5, "grad_norm": float("inf")}, None)


def test_a_failing_evaluation_keeps_the_steps_checkpoint(world, tmp_path, monkeypatch):
  def down(*_):
    raise ConnectionError("simulator server down")
  monkeypatch.setattr(train, "evaluate_holdout", down)
  config = _config(world, "grpo", total_steps=2, **{"eval.every_steps": 1, "checkpoint.every_steps": 1,
                                                    "data.num_holdout": 1, "eval.num_profiles": 0})
  with pytest.raises(ConnectionError):
    train.run(RunSpec.from_config(config), str(tmp_path))
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=3)
  assert ckpt.latest_step() == 1  # saved before the evaluation failed
  ckpt.close()
  assert [m["step"] for m in _metrics(tmp_path)] == [1]


def test_evaluation_metrics_join_their_steps_row(world, tmp_path):
  config = _config(world, "grpo", total_steps=2, **{"eval.every_steps": 2, "data.num_holdout": 1,
                                                    "eval.num_profiles": 1, "eval.max_turns": 1})
  train.run(RunSpec.from_config(config), str(tmp_path))
  rows = _metrics(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  assert "eval/score" not in rows[0] and "eval/score" in rows[1] and "reward_mean" in rows[1]
  # Per-step counts in metrics.jsonl (the scripted simulator has no prefill to count).
  assert rows[0]["optimizer_updates"] >= 1 and rows[0]["policy_prefill_tokens"] > 0
  assert "simulator_prefill_tokens" not in rows[0]


def _main(args, **kw):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO / "tests" / "fixtures"))
  return subprocess.Popen([sys.executable, "-m", "rlver_jax.main", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _flags(world, algo, workdir, steps):
  out = [f"--config={REPO}/configs/{algo}_nothink.py", f"--workdir={workdir}",
         f"--config.total_steps={steps}"]
  for k, v in tiny_world.tiny_overrides(world, algo).items():
    out.append(f"--config.{k}={v}")
  return out


def test_sigterm_saves_a_restorable_checkpoint(world, tmp_path):
  proc = _main(_flags(world, "grpo", tmp_path, 1000) + ["--config.checkpoint.every_steps=1000"])
  metrics = tmp_path / "metrics.jsonl"
  deadline = time.time() + 300
  while not metrics.exists() and time.time() < deadline and proc.poll() is None:
    time.sleep(0.5)
  assert proc.poll() is None, proc.communicate()[1][-2000:]
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  # Its own status and line: a retry loop must not take a preempted run for a finished one.
  assert proc.returncode == PREEMPTED_EXIT, err[-2000:]
  last = err.strip().splitlines()[-1]
  ckpt = Checkpointer(str(tmp_path), every_steps=1000, keep=3)
  step = ckpt.latest_step()
  assert step is not None and step >= 1 and step < 1000
  assert last == f"preempted at step {step} of 1000; run the same command to resume", err[-2000:]
  rows = _metrics(tmp_path)  # every saved step has its row (saved only after it was written)
  assert [r["step"] for r in rows][:step] == list(range(1, step + 1))
  assert ckpt.restore_meta(step)["step"] == step
  ckpt.close()
  _, step_b = _params(tmp_path, _config(world, "grpo", total_steps=1000,
                                        **{"checkpoint.every_steps": 1000}))
  assert step_b == step


def _wait_until_sigterm_is_caught(proc, timeout=120):
  """Until the child has its own SIGTERM handler (bit 15 of SigCgt in /proc): before that the
  interpreter itself is still starting (site-packages, .pth files; over 0.3 s on a loaded machine),
  where no Python program can catch a signal. jax's import, seconds long, is still ahead."""
  status = pathlib.Path(f"/proc/{proc.pid}/status")
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    caught = [l for l in status.read_text().splitlines() if l.startswith("SigCgt:")]
    if caught and int(caught[0].split()[1], 16) >> (signal.SIGTERM - 1) & 1:
      return
    time.sleep(0.005)
  raise AssertionError("the child never installed a SIGTERM handler")


def test_sigterm_while_starting_is_a_preemption_too(world, tmp_path):
  """During imports (before any handler of the trainer) and while the trainer loads or restores:
  not a bare death by signal (-15), which a retry loop on 75 would not re-run."""
  for wait_for in (None, tmp_path / "late" / "config.json"):  # written once the models loaded
    workdir = tmp_path / ("early" if wait_for is None else "late")
    proc = _main(_flags(world, "grpo", workdir, 1000))
    deadline = time.time() + 300
    while wait_for is not None and not wait_for.exists() and time.time() < deadline \
        and proc.poll() is None:
      time.sleep(0.05)
    if wait_for is None:
      _wait_until_sigterm_is_caught(proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT, err[-2000:]
    assert "run the same command to resume" in err.strip().splitlines()[-1], err[-2000:]


@pytest.mark.parametrize("flag,message", [
    ("--config.data.profiles=/nonexistent/p.jsonl", "config.data.profiles"),
    ("--config.policy.checkpoint=/nonexistent/model", "config.policy.checkpoint"),
    ("--config.mesh.fsdp=3", "config.mesh"),
    ("--config.no_such_key=1", "no_such_key"),
    ("--workdir=/proc", "--workdir=/proc: is not writable"),  # found before the models load
    ("--config.rl.reward_mode=per_turn", "config.rl.reward_mode"),  # GRPO would ignore it
    (("--config.simulator.backend=http", "--config.simulator.http_base_url=http://127.0.0.1:9/v1",
      "--config.simulator.http_model=x", "--config.simulator.http_max_attempts=1"),
     "failed after 1 attempts"),  # an unreachable simulator server
])
def test_bad_input_is_one_clear_line(world, tmp_path, flag, message):
  flags = list(flag) if isinstance(flag, tuple) else [flag]
  proc = _main(_flags(world, "grpo", tmp_path / "w", 1) + flags)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode != 0
  last = [l for l in err.strip().splitlines() if l.strip()][-1]
  assert last.startswith("error: ") and message in last, err[-3000:]
  assert "Traceback" not in err, err[-3000:]


def test_default_workdir_is_not_left_behind_by_a_failed_start(world, tmp_path):
  """Without --workdir the run makes ./runs/CONFIG-TIME; stopped by a bad profiles path before
  writing anything, it removes that directory again."""
  args = [a for a in _flags(world, "grpo", tmp_path, 1) if not a.startswith("--workdir")]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO / "tests" / "fixtures"))
  proc = subprocess.run([sys.executable, "-m", "rlver_jax.main", *args,
                         "--config.data.profiles=/nonexistent/p.jsonl"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "config.data.profiles" in proc.stderr.strip().splitlines()[-1]
  # The default workdir is made up front and removed again since the run wrote nothing to it.
  assert (tmp_path / "runs").is_dir() and not list((tmp_path / "runs").iterdir())


def test_default_workdirs_made_in_the_same_second_differ(tmp_path):
  """Two runs started in the same second must not share (and resume into) one workdir."""
  from rlver_jax.run.workdir import new_run_dir
  made = [new_run_dir(str(tmp_path / "runs"), "grpo_think-20261201-101010") for _ in range(3)]
  assert [os.path.basename(p) for p in made] == [
      "grpo_think-20261201-101010", "grpo_think-20261201-101010-2", "grpo_think-20261201-101010-3"]
  assert all(os.path.isdir(p) for p in made)


def test_checkpointer_takes_a_relative_workdir(tmp_path, monkeypatch):
  """`--workdir=runs/x` (and the default ./runs/NAME-TIME) is relative; orbax wants absolute paths."""
  monkeypatch.chdir(tmp_path)
  state = {"w": jax.numpy.arange(4.0)}
  ckpt = Checkpointer("runs/x", every_steps=1, keep=1)
  ckpt.save(1, state, {"step": 1})
  ckpt.wait()
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
  restored, meta = ckpt.restore(abstract)
  ckpt.close()
  np.testing.assert_array_equal(restored["w"], state["w"])
  assert meta["step"] == 1 and (tmp_path / "runs" / "x" / "checkpoints" / "1").is_dir()


def test_packed_shapes_come_from_few_buckets():
  # Each new packed shape recompiles the update, log-prob and value programs (minutes at 7B): think
  # mode varies the number of samples per step and every step its longest sample.
  from types import SimpleNamespace
  from rlver_jax.env.rollout import Sample
  rng = np.random.default_rng(0)
  shapes = set()
  for _ in range(200):
    n, longest = int(rng.integers(1, 200)), int(rng.integers(1, 8193))
    lengths = [longest] + list(rng.integers(1, longest + 1, size=n - 1))
    samples = [Sample(0, [7] * L, [0] + [1] * (L - 1), [-1.0] * L, [L - 1]) for L in lengths]
    p = pack([SimpleNamespace(samples=samples)], 8, pad_id=0)
    N, T = p.tokens.shape
    assert n <= N < 1.5 * max(n, 8) + 8 and N % 8 == 0
    assert longest <= T < 1.5 * max(longest, 64) + 64 and T % 64 == 0
    assert p.num_real == n and p.loss_mask[n:].sum() == 0 and (p.dialogue[n:] == -1).all()
    shapes.add((N, T))
  Ns, Ts = {s[0] for s in shapes}, {s[1] for s in shapes}
  assert len(Ns) <= 10 and len(Ts) <= 14, (sorted(Ns), sorted(Ts))  # vs 25 x 128 rounded shapes


class _CountingGuard:
  """A PreemptionGuard stand-in that reports SIGTERM from its `fire_at`-th poll on."""

  signum = signal.SIGTERM

  def __init__(self, fire_at=None):
    self.fire_at, self.calls = fire_at, 0

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  def agreed(self):
    self.calls += 1
    return self.fire_at is not None and self.calls >= self.fire_at


def test_sigterm_during_a_rollout_saves_the_last_step_and_resumes_exactly(world, tmp_path, monkeypatch):
  cfg = lambda steps: _config(world, "grpo", total_steps=steps, **{"checkpoint.every_steps": 100})
  counter = _CountingGuard()
  monkeypatch.setattr(train, "PreemptionGuard", lambda *_: counter)
  train.run(RunSpec.from_config(cfg(1)), str(tmp_path / "probe"))
  per_step = counter.calls  # the polls of one step: one per rollout turn and one after the step
  assert per_step >= 2
  # Fire at step 2's first turn: its rollout is dropped, step 1 is saved (every_steps would not).
  monkeypatch.setattr(train, "PreemptionGuard", lambda *_: _CountingGuard(fire_at=per_step + 1))
  interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
  paths = train.run(RunSpec.from_config(cfg(3)), str(interrupted))
  assert paths["step"] == "1" and paths["outcome"] == "preempted" and [m["step"] for m in _metrics(interrupted)] == [1]
  monkeypatch.setattr(train, "PreemptionGuard", lambda *_: _CountingGuard())
  train.run(RunSpec.from_config(cfg(3)), str(interrupted))  # resumes from step 1
  train.run(RunSpec.from_config(cfg(3)), str(straight))
  a, step_a = _params(straight, cfg(3))
  b, step_b = _params(interrupted, cfg(3))
  assert step_a == step_b == 3
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  assert [m["reward_mean"] for m in _metrics(straight)] == [m["reward_mean"] for m in _metrics(interrupted)]


def test_checkpoints_keep_the_latest_and_skip_steps_between_saves(tmp_path):
  ckpt = Checkpointer(str(tmp_path), every_steps=2, keep=2)
  saved = [s for s in range(1, 8) if ckpt.should_save(s, total_steps=7)]
  assert saved == [2, 4, 6, 7]  # every 2 steps, and the last one
  for s in saved:
    ckpt.save(s, {"w": np.full(3, float(s), np.float32)}, {"step": s})
  ckpt.wait()
  assert ckpt.all_steps() == [6, 7]
  state, meta = ckpt.restore({"w": jax.ShapeDtypeStruct((3,), np.float32)})
  assert meta == {"step": 7} and np.asarray(state["w"]).tolist() == [7.0] * 3
  ckpt.close()


def test_optimizer_moments_are_sharded_like_their_params(world, tmp_path):
  """Adam's moments take their params' shardings at start and after a resume (jit alone replicated
  them on every device: 56 GB per chip for a 7B policy)."""
  import optax
  config = _config(world, "ppo", total_steps=1)

  def check(trainer):
    sharded = 0
    for name, up in (("policy", trainer.policy_up), ("critic", trainer.critic_up)):
      params = getattr(trainer.state, name)
      same = optax.tree_map_params(
          up.optimizer, lambda m, p: m.sharding.is_equivalent_to(p.sharding, p.ndim),
          getattr(trainer.state, f"{name}_opt"), params, transform_non_params=lambda _: True)
      assert all(jax.tree.leaves(same)), name
      sharded += sum(not p.sharding.is_fully_replicated for p in jax.tree.leaves(params))
    assert sharded > 0  # the 8-device mesh does shard the params, so the check means something

  trainer = tiny_world.trainer(config, str(tmp_path))
  check(trainer)
  trainer.train_step()
  trainer.save()
  trainer.checkpointer.close()
  resumed = tiny_world.trainer(config, str(tmp_path))
  assert resumed.restore_if_any()
  check(resumed)
  resumed.checkpointer.close()


def test_sigterm_during_an_evaluation_saves_the_step_and_the_resume_redoes_the_evaluation(
    world, tmp_path, monkeypatch):
  evaluating = {"eval.every_steps": 1, "data.num_holdout": 1, "eval.num_profiles": 1,
                "eval.max_turns": 2, "checkpoint.every_steps": 100}
  cfg = lambda: _config(world, "grpo", total_steps=1, **evaluating)
  probe = _CountingGuard()
  monkeypatch.setattr(train, "PreemptionGuard", lambda *_: probe)
  train.run(RunSpec.from_config(_config(world, "grpo", total_steps=1)), str(tmp_path / "probe"))
  per_step = probe.calls  # the rollout's polls and the one after the step; the evaluation's follow
  monkeypatch.setattr(train, "PreemptionGuard", lambda *_: _CountingGuard(fire_at=per_step + 1))
  interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
  assert train.run(RunSpec.from_config(cfg()), str(interrupted))["step"] == "1"
  ckpt = Checkpointer(str(interrupted), every_steps=100, keep=1)
  assert ckpt.latest_step() == 1  # saved although every_steps=100 would not have
  ckpt.close()
  assert "eval/score" not in _metrics(interrupted)[0]
  monkeypatch.setattr(train, "PreemptionGuard", lambda *_: _CountingGuard())
  # Nothing left to train: only the missing evaluation runs.
  train.run(RunSpec.from_config(cfg()), str(interrupted))
  train.run(RunSpec.from_config(cfg()), str(straight))
  redone, want = _metrics(interrupted), _metrics(straight)
  assert [r["step"] for r in redone] == [1]
  assert {k: v for k, v in redone[0].items() if k.startswith("eval/")} == \
      {k: v for k, v in want[0].items() if k.startswith("eval/")}


def test_a_save_killed_mid_commit_leaves_no_tmp_folder_behind(tmp_path):
  state = {"w": jax.numpy.arange(4.0)}
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=2)
  ckpt.save(1, state, {"step": 1})
  ckpt.close()
  orphan = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1764590000000000"
  (orphan / "state").mkdir(parents=True)  # what a kill during step 2's commit leaves
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=2)
  assert ckpt.latest_step() == 1
  ckpt.save(2, state, {"step": 2})  # orbax removes tmp folders in the background, done before a save
  ckpt.close()
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2"]


def test_a_resume_drops_what_an_unsaved_later_attempt_wrote(world, tmp_path):
  cfg = _config(world, "grpo", total_steps=1, **{"log.transcripts_every": 1})
  train.run(RunSpec.from_config(cfg), str(tmp_path))
  # An attempt that got to steps 2 and 3 and died before saving either.
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 2, "reward_mean": 0.5}\n{"step": 3, "reward_mean": 0.6}\n')
  for step in (2, 3):
    (tmp_path / "transcripts" / f"step_{step:06d}.jsonl").write_text("{}\n")
  (tmp_path / "transcripts" / "step_notes.jsonl").write_text("mine\n")  # not ours: left alone
  trainer = tiny_world.trainer(cfg, str(tmp_path))
  assert trainer.restore_if_any() and trainer.step == 1
  trainer.checkpointer.close()
  assert [m["step"] for m in _metrics(tmp_path)] == [1]
  assert sorted(p.name for p in (tmp_path / "transcripts").iterdir()) == [
      "step_000001.jsonl", "step_notes.jsonl"]


def test_a_resume_on_a_different_batch_sharding_is_reported(world, tmp_path, monkeypatch, caplog):
  cfg = _config(world, "grpo", total_steps=1)
  real = trainer_module.batch_shards
  monkeypatch.setattr(trainer_module, "batch_shards", lambda mesh: 2 * real(mesh))  # "saved on a bigger slice"
  train.run(RunSpec.from_config(cfg), str(tmp_path))
  monkeypatch.setattr(trainer_module, "batch_shards", real)
  trainer = tiny_world.trainer(cfg, str(tmp_path))
  with caplog.at_level("WARNING"):
    assert trainer.restore_if_any()
  trainer.checkpointer.close()
  n = real(trainer.mesh)
  assert f"trained with {2 * n} batch shards, this mesh has {n}" in caplog.text
