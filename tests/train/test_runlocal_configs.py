"""Shipped training configs of both algorithms and modes, in their `:runlocal` form, run one step
end to end on the embedded SmolLM2 (policy and co-located simulator), writing metrics, a
checkpoint, transcripts and a reward plot. The runs share one process on one CPU device (as `make
demo` runs), so programs compiled for the first are reused by the others; 8 fake devices would
hold 8 copies of everything."""
import json
import os
import pathlib
import subprocess
import sys

from rlver_jax.run.checkpoint import Checkpointer

REPO = pathlib.Path(__file__).resolve().parents[2]
# Both algorithms and both modes; the other two configs differ from these only in keys the
# one-default test pins (tests/spec/test_one_default.py) and in what these two runs already cover.
RUNS = [("grpo_think", "runlocal"), ("ppo_nothink", "runlocal,simulator=challenging")]

_SCRIPT = """
import gc, importlib.util, sys
import jax
from rlver_jax.train import loop as train
from rlver_jax.spec import RunSpec
for name, arg, workdir in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
  spec = importlib.util.spec_from_file_location(name, f"configs/{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  # Shorter than the demo, same programs: one step, one turn, short replies.
  config.total_steps = 1
  config.simulator.max_turns = 1
  config.policy.max_new_tokens = 12
  config.simulator.max_new_tokens = 16
  config.log.progress_bar = False
  print(name, train.run(RunSpec.from_config(config), workdir), flush=True)
  # Free this config's programs before the next: four runs' worth in one process reached 9.6 GB and
  # was killed by the OOM killer beside the other test worker (the persistent cache still serves them).
  jax.clear_caches()
  gc.collect()
"""


def test_runlocal_configs_run_one_step(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  # Each run's Trainer jits its update and log-prob programs anew; this run-local persistent cache
  # lets a later config load what an earlier one compiled for the same shapes.
  env.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  args = [a for name, arg in RUNS for a in (name, arg, str(tmp_path / name))]
  proc = subprocess.run([sys.executable, "-c", _SCRIPT, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=2400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name, arg in RUNS:
    workdir = tmp_path / name
    config = json.loads((workdir / "config.json").read_text())
    assert config["policy"]["checkpoint"] == config["simulator"]["checkpoint"] == "embedded"
    assert config["simulator"]["backend"] == "model"
    assert config["policy"]["think"] == name.endswith("_think")
    assert config["simulator"]["style"] == ("challenging" if "challenging" in arg else "vanilla")
    rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    m = rows[0]
    assert 0.0 <= m["reward_mean"] <= 1.0 and m["policy_tokens"] > 0
    assert ("critic/vf_loss" in m) == name.startswith("ppo")
    transcripts = list((workdir / "transcripts").glob("*.jsonl"))
    assert transcripts and transcripts[0].read_text().strip()
    assert (workdir / "reward.png").exists()
    ckpt = Checkpointer(str(workdir), every_steps=1, keep=1)
    assert ckpt.latest_step() == 1
    ckpt.close()
