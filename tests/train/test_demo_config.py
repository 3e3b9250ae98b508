"""`make demo`'s config: the scripted user on the venting demo profiles, `:model` one swap away, and
the same run, shortened to 2 steps of one short turn, ending with its summary and outputs (the
reward margin of the full run is a benchmark in the README, not a test)."""
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _demo(arg=None):
  spec = importlib.util.spec_from_file_location("demo_config", REPO / "configs" / "demo.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def test_model_argument_swaps_only_the_simulator_and_profiles():
  scripted, model = _flat(_demo().to_dict()), _flat(_demo("model").to_dict())
  assert {k for k in scripted if scripted[k] != model[k]} == {"simulator.backend", "data.profiles"}
  assert (scripted["simulator.backend"], scripted["data.profiles"]) == ("scripted", "demo_venting")
  assert (model["simulator.backend"], model["data.profiles"]) == ("model", "demo")
  assert scripted["policy.checkpoint"] == "embedded" and scripted["algo"] == "grpo"
  with pytest.raises(ValueError, match="unknown config argument"):
    _demo("runlocal")


def test_venting_profiles_are_the_demo_people_wanting_to_be_heard():
  from rlver_jax.build import profiles_from
  from rlver_jax.env.profiles import intention_key
  demo, venting = profiles_from("demo"), profiles_from("demo_venting")
  assert [p.player for p in venting] == [p.player for p in demo]
  assert {intention_key(p) for p in venting} == {"listen_venting"}


def test_the_demo_shortened_prints_its_summary_and_writes_its_outputs(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "rlver_jax.main", "--config=configs/demo.py", f"--workdir={tmp_path}",
       "--config.total_steps=2", "--config.eval.every_steps=2", "--config.checkpoint.every_steps=2",
       "--config.simulator.max_turns=1", "--config.policy.max_new_tokens=12"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "run finished at step 2" in out and "mean of the first 1 steps" in out
  assert re.search(r"step 2 held-out evaluation: score [\d.]+", out)
  assert "a late dialogue (step 2" in out and f"--logdir {tmp_path}/tensorboard" in out
  assert not re.search(r"^I\d{4} .*(orbax|checkpoint_manager)", proc.stderr, re.M)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["simulator"]["backend"] == "scripted"
  assert (tmp_path / "reward.png").exists()
  assert (tmp_path / "transcripts" / "step_000002.jsonl").read_text().strip()
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
