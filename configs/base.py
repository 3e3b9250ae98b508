"""Shared RLVER training config; `grpo_think.py` and friends choose the algorithm and think mode.

Arguments (after the config path, comma-separated): `runlocal` shrinks the run to a CPU machine on the
embedded model and English demo profiles; `simulator=challenging` picks the simulator style.
Every key the trainer reads is declared here; the config is locked, so a typo fails at once.
"""
from __future__ import annotations

import ml_collections

# The paper's settings (RLVER_SPEC.md section 6) for a Qwen2.5-7B-Instruct policy.
PAPER_POLICY = "Qwen/Qwen2.5-7B-Instruct"


def parse_arg(arg: str | None) -> dict[str, str]:
  out = {}
  for part in (arg or "").split(","):
    part = part.strip()
    if not part:
      continue
    key, _, value = part.partition("=")
    out[key] = value or "true"
  unknown = set(out) - {"runlocal", "simulator"}
  if unknown:
    raise ValueError(f"unknown config argument(s) {sorted(unknown)}; known: runlocal, simulator=STYLE")
  return out


def get_base_config(algo: str, think: bool, arg: str | None) -> ml_collections.ConfigDict:
  args = parse_arg(arg)
  c = ml_collections.ConfigDict()
  c.algo = algo                      # "grpo" | "ppo"
  c.seed = 0
  c.total_steps = 210 if algo == "grpo" else 350

  c.policy = ml_collections.ConfigDict()
  c.policy.checkpoint = "gs://YOUR_BUCKET/models/Qwen2.5-7B-Instruct"  # HF safetensors directory
  # Architecture preset for `python -m rlver_jax.aot` only (it compiles without reading checkpoints);
  # training reads the architecture from the checkpoint. "NAME:L" keeps NAME's widths with L layers.
  c.policy.preset = "qwen2.5-7b"
  c.policy.param_dtype = "float32"   # fp32 master weights
  c.policy.compute_dtype = "bfloat16"
  c.policy.remat = "full"
  c.policy.max_context = 8192        # KV cache slots per dialogue (all turns)
  # Appended token counts are padded up to one of these (one compiled program each); the largest is
  # also the chunk a long prefill is cut into. Policy appends: user turns (~16-64 tokens), prefills.
  c.policy.append_buckets = (16, 64, 256, 1024)
  c.policy.think = think
  c.policy.keep_thoughts = False     # think mode: earlier thoughts are dropped from later turns
  c.policy.max_new_tokens = 1024     # per turn (the reference allows 5,000)
  c.policy.temperature = 1.0
  c.policy.top_p = 1.0
  c.policy.top_k = 0
  c.policy.language = ""             # system prompt language; "" = each profile's own

  c.critic = ml_collections.ConfigDict()
  c.critic.checkpoint = ""           # "" = initialise from the policy checkpoint + a zero value head

  c.simulator = ml_collections.ConfigDict()
  c.simulator.backend = "model"      # "model" (co-located) | "http" | "scripted"
  c.simulator.checkpoint = "gs://YOUR_BUCKET/models/Qwen2.5-72B-Instruct"
  c.simulator.preset = "qwen2.5-72b"  # for rlver_jax.aot only, like policy.preset
  c.simulator.dtype = "bfloat16"
  c.simulator.style = args.get("simulator", "vanilla")
  c.simulator.max_context = 16384
  # Simulator appends are a policy reply plus an instruction, ~150-700 tokens: finer buckets there.
  c.simulator.append_buckets = (64, 128, 256, 512, 1024)
  c.simulator.max_new_tokens = 512
  c.simulator.temperature = 0.7
  c.simulator.top_p = 0.9
  c.simulator.top_k = 0
  c.simulator.start_emotion = 30
  c.simulator.max_turns = 8
  c.simulator.max_parse_retries = 2  # re-asks of an unreadable change line and of a missing reply line
  c.simulator.http_base_url = ""
  c.simulator.http_model = ""
  c.simulator.http_api_key_env = "OPENAI_API_KEY"
  c.simulator.http_timeout_s = 120.0
  c.simulator.http_max_attempts = 4
  c.simulator.http_max_concurrency = 8

  c.data = ml_collections.ConfigDict()
  c.data.profiles = "gs://YOUR_BUCKET/data/train_profile.jsonl"
  c.data.num_holdout = 20            # held out from training for periodic evaluation

  c.rl = ml_collections.ConfigDict()
  c.rl.profiles_per_step = 32
  c.rl.group_size = 4 if algo == "grpo" else 1
  c.rl.epochs = 1
  c.rl.mini_batches = 1
  c.rl.micro_batch_size = 4          # rows per batch shard (data x fsdp device); x shards = global
  c.rl.grpo_mean_only = False        # Dr.GRPO: no division by the group std
  c.rl.gamma = 1.0
  c.rl.lam = 1.0
  c.rl.whiten_advantages = True
  c.rl.reward_mode = "terminal"      # or "per_turn" (emotion deltas on each turn's last token)
  c.rl.format_penalty = False       # think mode only: a malformed reply scores 0
  c.rl.clip_low = 0.2
  c.rl.clip_high = 0.2
  c.rl.dual_clip = 0.0               # 0 = off
  c.rl.value_clip = 0.5
  c.rl.entropy_coef = 0.001
  c.rl.loss_agg = "token-mean"       # seq-* modes count samples: with think mode, one per turn
  c.rl.loss_norm_len = 0             # seq-mean-token-sum-norm divisor; 0 = policy.max_context
  c.rl.kl_coef = 0.0                 # no reference model, as in the paper
  c.rl.kl_kind = "k3"
  c.rl.kl_in_reward = False
  c.rl.tis_cap = 0.0                 # truncated IS against sampler log-probs; 0 = off
  c.rl.logits_chunk = 1024

  c.optim = ml_collections.ConfigDict()
  c.optim.actor_lr = 1e-6
  c.optim.critic_lr = 5e-6
  c.optim.warmup_steps = 10          # optimizer updates (epochs x mini_batches per RL step), not RL steps
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0            # global-norm clip; 0 = off

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 10
  c.checkpoint.keep = 3

  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 50            # 0 = never
  c.eval.num_profiles = 20
  c.eval.start_emotion = 40
  c.eval.max_turns = 9              # policy replies: the opening + 9 replies = up to 10 user lines
  # Policy sampling during held-out evaluation: the same as configs/eval_sentient.py (Qwen2.5-Instruct's
  # generation_config), so eval/score is comparable with `rlver_jax.evaluate`, not rollout sampling.
  c.eval.temperature = 0.7
  c.eval.top_p = 0.8
  c.eval.top_k = 20

  c.log = ml_collections.ConfigDict()
  c.log.transcripts_every = 10
  c.log.progress_bar = True

  if "runlocal" in args:
    _runlocal(c)
  c.lock()
  return c


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
  c.checkpoint.every_steps = 2
  c.eval.every_steps = 0
  c.eval.num_profiles = 2
  c.eval.max_turns = 2
  c.log.transcripts_every = 1
