"""RLVER GRPO, no-think mode: Qwen2.5-7B-Instruct policy, the paper's settings.

Launch (TPU pod slice; every worker runs the same command):
  python -m rlver_jax.main --config=configs/grpo_nothink.py --workdir=gs://BUCKET/runs/grpo_nothink \
    --config.policy.checkpoint=gs://BUCKET/models/Qwen2.5-7B-Instruct \
    --config.simulator.checkpoint=gs://BUCKET/models/Qwen2.5-72B-Instruct \
    --config.data.profiles=gs://BUCKET/data/train_profile.jsonl
Challenging simulator: --config=configs/grpo_nothink.py:simulator=challenging
The reference implementation's behaviours (docs/REPRODUCING.md): `:reference`, e.g. `:reference,runlocal`.
On a CPU machine with the embedded model: python -m rlver_jax.main --config=configs/grpo_nothink.py:runlocal
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402


def get_config(arg=None):
  return base.get_base_config("grpo", think=False, arg=arg)
