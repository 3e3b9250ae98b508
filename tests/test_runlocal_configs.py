"""Each shipped training config, in its `:runlocal` form, runs one step end to end on the embedded
SmolLM2 (policy and co-located simulator), writing metrics, a checkpoint and transcripts."""
import importlib.util
import json
import pathlib

import pytest

from rlver_jax import train
from rlver_jax.checkpoint import Checkpointer

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def _load(name: str, arg: str):
  spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.mark.parametrize("name,arg", [("grpo_think", "runlocal"), ("grpo_nothink", "runlocal"),
                                      ("ppo_think", "runlocal,simulator=challenging"),
                                      ("ppo_nothink", "runlocal")])
def test_runlocal_config_runs_one_step(tmp_path, name, arg):
  config = _load(name, arg)
  assert config.policy.checkpoint == config.simulator.checkpoint == "embedded"
  assert config.simulator.backend == "model"
  # Shorter than the demo, same programs: one turn, short replies.
  config.total_steps = 1
  config.simulator.max_turns = 1
  config.policy.max_new_tokens = 12
  config.simulator.max_new_tokens = 16
  config.log.progress_bar = False
  paths = train.run(config, str(tmp_path))
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1]
  m = rows[0]
  assert 0.0 <= m["reward_mean"] <= 1.0 and m["policy_tokens"] > 0
  assert ("critic/vf_loss" in m) == name.startswith("ppo")
  assert json.loads((tmp_path / "config.json").read_text())["simulator"]["style"] == (
      "challenging" if "challenging" in arg else "vanilla")
  transcripts = list((tmp_path / "transcripts").glob("*.jsonl"))
  assert transcripts and transcripts[0].read_text().strip()
  assert pathlib.Path(paths["reward_plot"]).exists()
  ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1)
  assert ckpt.latest_step() == 1
  ckpt.close()
