r"""Sentient-style evaluation (SAGE; RLVER_SPEC.md section 7) of a policy checkpoint.

Launch (TPU pod slice; every worker runs the same command):
  python -m rlver_jax.evaluate --config=configs/eval_sentient.py --workdir=gs://BUCKET/evals/ppo_think \
    --config.policy.checkpoint=gs://BUCKET/exports/ppo_think \
    --config.simulator.checkpoint=gs://BUCKET/models/Qwen2.5-72B-Instruct \
    --config.data.profiles=gs://BUCKET/data/sentient_profiles.jsonl
A trained run is evaluated after `python -m rlver_jax.export --workdir=RUN --out=HF_DIR`.
No-think policy: `:think=false`; challenging simulator: `:simulator=challenging` (comma-separated).
On a CPU machine with the embedded model: `--config=configs/eval_sentient.py:runlocal`.
The paper's simulator was an API model (DeepSeek-V3): `--config.simulator.backend=http` with
`--config.simulator.http_base_url=... --config.simulator.http_model=...`.

Turn budget: `eval.max_turns` counts policy replies, each followed by one scored emotion update. The
benchmark allows up to 10 user utterances: the opening plus one after each of 9 policy replies, so
9 scored updates (max_turns = 9). The 10th user utterance, after the last update, is not generated:
no policy reply follows it and it cannot change the score. Dialogues also end earlier on a goodbye,
below emotion 10 (state F, `eval.end_below`) or at emotion 100.

Every setting that changes results is an explicit value of the config (policy and simulator
sampling, the start emotion, the turn budget, SAGE's change and goodbye rules, the simulator style,
the prompts' language), declared with its default in rlver_jax/spec/ and written to the
evaluation's config.json.
"""
from __future__ import annotations

import ml_collections

from rlver_jax.spec import EvaluationSpec, default_tree

STYLES = ("vanilla", "challenging")


def _parse_arg(arg: str | None) -> dict[str, str]:
  out = {}
  for part in (arg or "").split(","):
    part = part.strip()
    if part:
      key, _, value = part.partition("=")
      out[key] = value or "true"
  unknown = set(out) - {"runlocal", "simulator", "think"}
  if unknown:
    raise ValueError(f"unknown config argument(s) {sorted(unknown)}; "
                     "known: runlocal, simulator=STYLE, think=true|false")
  if out.get("simulator", "vanilla") not in STYLES:
    raise ValueError(f"simulator={out['simulator']}: expected one of {STYLES}")
  if out.get("think", "true") not in ("true", "false"):
    raise ValueError(f"think={out['think']}: expected true or false")
  return out


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Every setting at the evaluation's default (declared once: EvaluationSpec and its sections in
  rlver_jax/spec/), then the paper's models and this argument's mode and style."""
  args = _parse_arg(arg)
  c = ml_collections.ConfigDict(default_tree(EvaluationSpec))
  c.policy.checkpoint = "gs://YOUR_BUCKET/models/Qwen2.5-7B-Instruct"  # HF safetensors directory
  c.simulator.checkpoint = "gs://YOUR_BUCKET/models/Qwen2.5-72B-Instruct"
  c.data.profiles = "gs://YOUR_BUCKET/data/sentient_profiles.jsonl"  # the 100 Sentient profiles
  c.policy.think = args.get("think", "true") == "true"
  c.simulator.style = args.get("simulator", c.simulator.style)
  if "runlocal" in args:
    _runlocal(c)
  c.lock()
  return c


def _runlocal(c: ml_collections.ConfigDict) -> None:
  """CPU-sized: the embedded SmolLM2-135M as policy and simulator, the English demo profiles."""
  for m in (c.policy, c.simulator):
    m.checkpoint = "embedded"
  c.policy.param_dtype = "float32"   # bf16 matmuls are slow on CPU
  c.policy.compute_dtype = "float32"
  c.policy.max_context = 1024
  c.eval.policy_max_new_tokens = 32
  c.simulator.dtype = "float32"
  c.simulator.max_context = 3072
  c.simulator.max_new_tokens = 48
  c.simulator.max_parse_retries = 1
  c.data.profiles = "demo"
  c.eval.num_profiles = 2          # a smoke run: minutes on 2 CPU cores, mostly compilation
  c.eval.max_turns = 2
  c.eval.batch_size = 2
