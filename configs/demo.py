"""`make demo`: GRPO on the embedded SmolLM2-135M against the scripted simulated user, sized to show
learning in about 10 minutes on 2 CPU cores.

  python -m rlver_jax.main --config=configs/demo.py           # scripted user (make demo)
  python -m rlver_jax.main --config=configs/demo.py:model     # co-located model user (make demo-model)

Why scripted: the embedded 135M model cannot play a SAGE user (it almost never writes a readable
change line, so every dialogue keeps its start emotion). The scripted user scores each reply by
documented rules (rlver_jax/env/scripted_rules.py). Its users here are the 8 demo people, each
wanting only to be heard (data.profiles="demo_venting"): a short reply without advice scores 0
instead of -2, and listening phrases ("I'm here", "tell me more") +4 each, a signal a 135M policy
sampling at T=1 meets often enough to learn from in a few steps. `:model` keeps every other value and
swaps in the co-located model simulator and the original demo profiles: the path for a real
simulator checkpoint (--config.simulator.checkpoint=HF_DIR).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402


def get_config(arg=None):
  if arg not in (None, "", "model"):
    raise ValueError(f"unknown config argument {arg!r}; known: model")
  c = base.get_base_config("grpo", think=False, arg="runlocal")
  c.total_steps = 15
  c.simulator.backend = "model" if arg == "model" else "scripted"
  c.data.profiles = "demo" if arg == "model" else "demo_venting"
  c.simulator.max_turns = 2
  c.policy.max_new_tokens = 32
  c.rl.profiles_per_step = 2      # 3 steps cover the 6 training profiles once
  c.rl.group_size = 4
  c.rl.micro_batch_size = 4
  c.optim.actor_lr = 5e-5
  c.checkpoint.every_steps = 5
  c.eval.every_steps = 5          # held-out dialogues in TensorBoard at steps 5, 10, 15
  c.eval.policy_prompt = "training"  # held-out = what the demo policy learned, under its own prompt
  return c
