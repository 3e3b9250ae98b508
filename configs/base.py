"""Shared RLVER training config; `grpo_think.py` and friends choose the algorithm and think mode.

Arguments (after the config path, comma-separated): `runlocal` shrinks the run to a CPU machine on the
embedded model and English demo profiles; `simulator=challenging` picks the simulator style;
`reference` sets every behaviour of the RLVER reference implementation that this project's defaults
change on purpose (and that is not one of its defects): docs/REPRODUCING.md lists them.
Every key is declared once, with its default and what it means, in rlver_jax/spec/ (sections.py,
rl_section.py; the defaults are the paper's settings, RLVER_SPEC.md section 6, where it states them);
this file sets only what the paper's run and each algorithm and mode set otherwise. The config is
locked, so a typo fails at once.
"""
from __future__ import annotations

import ml_collections

from rlver_jax.spec import RunSpec, default_tree


def parse_arg(arg: str | None) -> dict[str, str]:
  out = {}
  for part in (arg or "").split(","):
    part = part.strip()
    if not part:
      continue
    key, _, value = part.partition("=")
    out[key] = value or "true"
  unknown = set(out) - {"runlocal", "simulator", "reference"}
  if unknown:
    raise ValueError(f"unknown config argument(s) {sorted(unknown)}; known: runlocal, "
                     "simulator=STYLE, reference")
  if out.get("reference", "true") != "true":
    raise ValueError(f"reference={out['reference']}: the argument takes no value")
  return out


def get_base_config(algo: str, think: bool, arg: str | None) -> ml_collections.ConfigDict:
  """The paper's run for `algo` ("grpo" | "ppo") in think or no-think mode: every setting at its
  default (declared once, in rlver_jax/spec/), then what the paper's run and this algorithm and
  mode set otherwise."""
  args = parse_arg(arg)
  c = ml_collections.ConfigDict(default_tree(RunSpec))
  c.algo = algo
  c.total_steps = 210 if algo == "grpo" else 350  # the paper's curves (its budget: 1000)
  # The paper's models: HF safetensors directories copied into a bucket once (or Hub ids,
  # docs/OPTIONS.md); the presets are their architectures for `python -m rlver_jax.aot` alone.
  c.policy.checkpoint = "gs://YOUR_BUCKET/models/Qwen2.5-7B-Instruct"
  c.policy.preset = "qwen2.5-7b"
  c.simulator.checkpoint = "gs://YOUR_BUCKET/models/Qwen2.5-72B-Instruct"
  c.simulator.preset = "qwen2.5-72b"
  c.data.profiles = "gs://YOUR_BUCKET/data/train_profile.jsonl"
  c.policy.think = think
  c.rl.format_penalty = think        # the paper's rule for the think format
  if algo == "ppo":
    c.rl.group_size = 1              # one dialogue per profile: the critic is the baseline
  c.simulator.style = args.get("simulator", c.simulator.style)
  # The 72B simulator's decode is bound by reading its weights and its attended cache window:
  # windows in steps of 256 slots past 256 (not 1024) read 2.0 s less of a grpo_think step on v5p-64
  # (the step-time model; docs/PERFORMANCE.md) for 7 more compiled programs. :runlocal keeps 1024.
  c.simulator.window_step = 256

  if "reference" in args:
    _reference(c)
  if "runlocal" in args:  # after :reference, so a CPU-sized run keeps its small shapes
    _runlocal(c)
  c.lock()
  return c


# Keys `:reference` changes, with the reference's values; the defaults above keep this project's
# choice for each (docs/REPRODUCING.md says why). The other reference behaviours are the defaults.
REFERENCE_VALUES = {
    "policy.max_new_tokens": 5000,    # the reference's per-turn cap
    "policy.max_context": 16384,      # room for a 5,000-token turn after a long history
    "simulator.clamp_change": False,  # its training path reads the change unclamped
    "data.num_holdout": 0,            # it trains on all 500 profiles ...
    "eval.every_steps": 0,            # ... and evaluates on the Sentient set afterwards
    "optim.warmup_unit": "steps",     # its scheduler steps once per RL step ...
    "optim.warmup_steps": 20,         # ... 20 of them for the actor
    "optim.critic_warmup_steps": 50,  # ... and 50 for the critic
    "simulator.state_change_range": 0,  # its training prompt states no range
    "simulator.end_above": 0,         # it ends on a goodbye or at 0, not at 100
    "simulator.goodbye_match": "substring",
    "rl.group_stats": "turn_rows",    # mean and std over the group's per-turn rows
    "data.sampling": "with_replacement",
    "policy.prompt": "reference",     # the released training prompts' meaning
    "policy.reply_cut": "reference",  # think: after the last 你：/你:; no-think: as it is
    "rl.loss_agg": "chunk-token-mean",  # a token mean per GPU's rows (rl.loss_agg_chunks = 32)
    "critic.value_mask": "reference",  # its critic's shifted attention mask
    "critic.head_init": "normal",
    "eval.state_change_range": 0,     # SAGE's rules in the held-out evaluation: no range stated,
    "eval.goodbye_match": "substring",  # the change clamped in code, 再见 / 拜拜 anywhere
}
# ... and in think mode only.
REFERENCE_THINK_VALUES = {
    "simulator.history_chars": 5000,  # its think-mode rollout ends a longer dialogue ...
    "simulator.history_measure": "rendered",  # ... counting its rendered prompt
}


def _reference(c: ml_collections.ConfigDict) -> None:
  values = {**REFERENCE_VALUES, **(REFERENCE_THINK_VALUES if c.policy.think else {})}
  for key, value in values.items():
    section, leaf = key.split(".")
    c[section][leaf] = value


def _runlocal(c: ml_collections.ConfigDict) -> None:
  """CPU-sized: the embedded SmolLM2-135M as policy and simulator, the English demo profiles."""
  c.total_steps = 2
  for m in (c.policy, c.simulator):
    m.checkpoint = "embedded"
  c.policy.param_dtype = "float32"
  c.policy.compute_dtype = "float32"   # bf16 matmuls are slow on CPU
  c.policy.remat = "full"             # keeps the update's activations within a laptop's memory
  c.policy.max_context = 1024
  c.policy.max_new_tokens = 32
  c.simulator.dtype = "float32"
  c.simulator.max_context = 3072
  c.simulator.max_new_tokens = 40
  c.simulator.window_step = 1024        # on a CPU a compile costs more than the slots it saves
  c.simulator.max_turns = 2
  c.simulator.max_parse_retries = 0   # a 135M simulator rarely fixes its format on a retry
  c.data.profiles = "demo"
  c.data.num_holdout = 2
  c.rl.profiles_per_step = 1 if c.algo == "grpo" else 2
  c.rl.group_size = 2 if c.algo == "grpo" else 1
  c.rl.micro_batch_size = 2
  c.rl.logits_chunk = 256
  c.optim.actor_lr = 1e-5
  c.optim.critic_lr = 5e-5
  c.optim.warmup_steps = 0
  c.optim.critic_warmup_steps = 0
  c.checkpoint.every_steps = 2
  c.eval.every_steps = 0
  c.eval.num_profiles = 2
  c.eval.max_turns = 2
  c.log.transcripts_every = 1
