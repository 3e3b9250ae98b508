"""Shared RLVER training config; `grpo_think.py` and friends choose the algorithm and think mode.

Arguments (after the config path, comma-separated): `runlocal` shrinks the run to a CPU machine on the
embedded model and English demo profiles; `simulator=challenging` picks the simulator style;
`reference` sets every behaviour of the RLVER reference implementation that this project's defaults
change on purpose (and that is not one of its defects): docs/REPRODUCING.md lists them.
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
  unknown = set(out) - {"runlocal", "simulator", "reference"}
  if unknown:
    raise ValueError(f"unknown config argument(s) {sorted(unknown)}; known: runlocal, "
                     "simulator=STYLE, reference")
  if out.get("reference", "true") != "true":
    raise ValueError(f"reference={out['reference']}: the argument takes no value")
  return out


def get_base_config(algo: str, think: bool, arg: str | None) -> ml_collections.ConfigDict:
  args = parse_arg(arg)
  c = ml_collections.ConfigDict()
  c.algo = algo                      # "grpo" | "ppo"
  c.seed = 0
  # JAX's persistent compilation cache, so a resumed or preempted run reads its compiled programs
  # back: beside the checkpoints ({workdir} = --workdir), where a run resumed on a new VM finds it;
  # '' = none (rlver_jax/run/compile_cache.py).
  c.compile_cache_dir = "{workdir}/compile_cache"
  c.total_steps = 210 if algo == "grpo" else 350

  c.policy = ml_collections.ConfigDict()
  # HF safetensors directory (local or gs://), or a Hub id ORG/NAME[@REV] (docs/OPTIONS.md)
  c.policy.checkpoint = "gs://YOUR_BUCKET/models/Qwen2.5-7B-Instruct"
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
  # A decode runs in calls of decode_segment tokens, each attending a window just past what its rows
  # can reach: powers of two up to window_step, then its multiples (one compiled program each).
  # Cost follows the filled cache (~1.05x) instead of the next power of two above it plus the whole
  # budget (~1.3x); 0 and 0 = one call a turn, power-of-two windows (sampling/sampler.py).
  c.policy.decode_segment = 128
  c.policy.window_step = 1024
  c.policy.think = think
  c.policy.keep_thoughts = False     # think mode: earlier thoughts are dropped from later turns
  c.policy.max_new_tokens = 1024     # per turn (the reference allows 5,000)
  c.policy.temperature = 1.0
  c.policy.top_p = 1.0
  c.policy.top_k = 0
  c.policy.language = ""             # system prompt language; "" = each profile's own
  # The training system prompt: "project" (this project's: the user's ease and trust, a thought on
  # what they want and feel, the reply's form) or "reference" (the released RLVER prompts' meaning:
  # an emotionally intelligent friend, a thought on reply strategy), both in this project's words.
  c.policy.prompt = "project"
  # Strings that end a policy turn inside the decode loop besides <|im_end|> (e.g. "<|im_start|>"
  # for a model that opens the next turn itself); () = none.
  c.policy.stop_sequences = ()
  # What of a reply the user sees: "label" (the text after </think> less one leading speaker
  # label such as "Assistant:") or "reference" (the RLVER reference's: think mode keeps the text
  # after the last 你：/你:, no-think mode the text as it is).
  c.policy.reply_cut = "label"

  c.critic = ml_collections.ConfigDict()
  c.critic.checkpoint = ""           # "" = initialise from the policy checkpoint + a new value head
  # The critic's loss trains on "policy_tokens" or "reference" (the reference's: from the first
  # policy token through the position after the sample's end, user tokens inside included).
  c.critic.value_mask = "policy_tokens"
  c.critic.head_init = "zeros"       # the new value head: "zeros" | "normal" (N(0, 0.02), the reference's)

  c.simulator = ml_collections.ConfigDict()
  c.simulator.backend = "model"      # "model" (co-located) | "http" | "scripted"
  c.simulator.checkpoint = "gs://YOUR_BUCKET/models/Qwen2.5-72B-Instruct"
  c.simulator.preset = "qwen2.5-72b"  # for rlver_jax.aot only, like policy.preset
  c.simulator.dtype = "bfloat16"
  # The frozen simulator's storage: "bf16" = as simulator.dtype; "int8" = symmetric int8 with a
  # scale per output channel (weights) or per token and KV head (KV cache): half the bytes that its
  # memory-bound decode reads (fidelity: README, benchmarks/int8_fidelity.py).
  c.simulator.weight_dtype = "bf16"
  c.simulator.kv_dtype = "bf16"
  c.simulator.style = args.get("simulator", "vanilla")
  # KV slots per dialogue. The 'reference' flow keeps a clean transcript (profile, every visible
  # line) plus one step's request and answer; 'chat' keeps every analysis and plan too (~16384).
  c.simulator.max_context = 8192
  # Simulator appends are a policy reply plus an instruction, ~150-700 tokens: finer buckets there.
  c.simulator.append_buckets = (64, 128, 256, 512, 1024)
  c.simulator.decode_segment = 128   # as policy.decode_segment / window_step
  c.simulator.window_step = 1024
  c.simulator.max_new_tokens = 512
  c.simulator.temperature = 0.7
  c.simulator.top_p = 0.9
  c.simulator.top_k = 0
  c.simulator.start_emotion = 30
  # Policy replies per dialogue. The reference's limit of 8 is checked after the user's reply, so its
  # training dialogues hold 9 policy replies; this counts them directly.
  c.simulator.max_turns = 9
  c.simulator.end_below = 1          # a dialogue ends when the emotion falls below this (1: at 0)
  # ... and when it reaches this (0: never; the user still leaves on a goodbye or at 0).
  c.simulator.end_above = 100
  c.simulator.clamp_change = True    # each stated change limited to [-10, 10] (as the benchmark)
  # The emotion prompt (and its retry) asks for a change in [-N, N]; 0 states no range.
  c.simulator.state_change_range = 10
  # Goodbye detection: "clause" (再见/拜拜 ending a clause, not negated; English farewells) or
  # "substring" (再见, 拜拜 or "bye" anywhere in the line).
  c.simulator.goodbye_match = "clause"
  # Training ends a dialogue whose visible text (user and policy lines) passes this many
  # characters; 0 = no limit (the policy's cache still bounds it: context_full).
  c.simulator.history_chars = 0
  # What it counts: "visible" (those lines) or "rendered" (the policy's prompt as the chat template
  # renders it: system prompt, role tags and the lines, as the reference counts).
  c.simulator.history_measure = "visible"
  # Decode layout of the frozen simulator over the same devices as config.mesh
  # (rlver_jax/spec/layouts.py): 'auto' (tensor parallel over heads, data over cache rows),
  # 'train' (config.mesh) or 'DATAxFSDPxTENSOR' such as '4x1x8'.
  c.simulator.mesh = "auto"
  c.simulator.score_guidance = False  # no "+3 to +10 for a good reply" scale (the reference has none)
  # What the simulator's steps see of each other: "reference" = the paper's: the emotion step sees a
  # clean transcript, the reply step only the fit/feeling notes and the state label, each step's
  # private answer rewound out of the cache once read (rlver_jax/env/info_flow.py); "chat" = one
  # growing chat (every later step sees the earlier analyses and plans; this project's runs before
  # 2026-12-07).
  c.simulator.info_flow = "reference"
  # "sampled": the change the simulator wrote; "expected": the mean of its own distribution over
  # -10..+10 where it wrote the value (model backend only; emotions become floats; see
  # rlver_jax/env/expected_change.py). The held-out evaluation keeps "sampled" (the benchmark's rule).
  c.simulator.change_mode = "sampled"
  c.simulator.max_parse_retries = 2  # re-asks of an unreadable change line and of a missing reply line
  c.simulator.http_base_url = ""
  c.simulator.http_model = ""
  c.simulator.http_api_key_env = "OPENAI_API_KEY"
  c.simulator.http_timeout_s = 120.0     # per connect / read
  c.simulator.http_deadline_s = 300.0    # per attempt, connect to last byte (a trickling server)
  c.simulator.http_max_attempts = 4
  c.simulator.http_max_concurrency = 8
  # A dialogue whose simulator request fails within its attempts ends as simulator_error (not
  # trained); a step with a larger share of those stops the run (after saving the last step).
  c.simulator.max_failed_share = 0.5
  # Model backend: end each decode on device right after its change line (emotion step) or reply
  # line (reply step, opening) instead of decoding the text after it (env/answer_stops.py). Off:
  # the parser reads the last label of a whole answer, so a model writing more labelled lines
  # after the first could get another result.
  c.simulator.stop_at_lines = False

  c.data = ml_collections.ConfigDict()
  c.data.profiles = "gs://YOUR_BUCKET/data/train_profile.jsonl"
  c.data.num_holdout = 20            # held out from training for periodic evaluation
  # "epochs": each profile once per shuffled epoch; "with_replacement": independent uniform draws.
  c.data.sampling = "epochs"

  c.rl = ml_collections.ConfigDict()
  c.rl.profiles_per_step = 32
  c.rl.group_size = 4 if algo == "grpo" else 1
  # A group's dialogues are copies of one state after the opening (the reference clones them), so
  # they share the user's first line and the group baseline compares replies to the same opening.
  c.rl.shared_opening = True
  # Their identical prefix (policy: system prompt + opening; simulator: persona, background, opening)
  # is computed once and its KV rows copied; False prefills it for every member (same tokens).
  c.rl.share_prefix = True
  c.rl.epochs = 1
  # Mini-batches counted in rows, like the reference: -1 = one step's dialogues (profiles_per_step x
  # group_size); in think mode every policy turn is a row, so a step makes about one optimizer update
  # per turn. 0 = a fixed count of rl.mini_batches per step instead.
  c.rl.mini_batch_rows = -1
  c.rl.mini_batches = 1              # used when rl.mini_batch_rows = 0
  # Rows per batch shard (data x fsdp device), x shards = global; at most: a micro-batch holds no
  # more rows than its mini-batch needs (rounded up to the shards), the rest would be padding.
  c.rl.micro_batch_size = 4
  c.rl.grpo_mean_only = False        # Dr.GRPO: no division by the group std
  # GRPO only. Dynamic sampling (DAPO): drop groups whose advantages are all 0 and roll out up to
  # dynamic_sampling_max_rounds more rounds of profiles_per_step groups to refill the batch; slots
  # still empty are filled with dropped groups at zero loss weight (the batch keeps its shape).
  c.rl.dynamic_sampling = False
  c.rl.dynamic_sampling_max_rounds = 2
  # GRPO only: "none" (the final reward on every turn), or each turn's return-to-go of emotion
  # changes normalised over the group's dialogues at the same turn ("turn_index") or over all of
  # the group's turns ("all_turns"); see rlver_jax/rl/turn_credit.py.
  c.rl.turn_credit = "none"
  c.rl.gamma = 1.0
  c.rl.lam = 1.0
  c.rl.whiten_advantages = True
  c.rl.reward_mode = "terminal"      # or "per_turn" (emotion deltas on each turn's last token)
  c.rl.format_penalty = think        # think mode only: a dialogue with a malformed turn scores 0
  # GRPO group mean and std: one value per dialogue ("dialogue"), or one per trained row
  # ("turn_rows": in think mode a row per turn, so long dialogues weigh more).
  c.rl.group_stats = "dialogue"
  c.rl.clip_low = 0.2
  c.rl.clip_high = 0.2
  c.rl.dual_clip = 0.0               # 0 = off
  c.rl.value_clip = 0.5
  c.rl.entropy_coef = 0.001
  c.rl.loss_agg = "token-mean"       # seq-* modes count samples: with think mode, one per turn
  # chunk-token-mean: a token mean inside each of this many consecutive runs of a mini-batch's
  # rows, then the mean of the runs (the reference: one run per GPU, 32 GPUs).
  c.rl.loss_agg_chunks = 32
  c.rl.loss_norm_len = 0             # seq-mean-token-sum-norm divisor; 0 = policy.max_context
  c.rl.kl_coef = 0.0                 # no reference model, as in the paper
  c.rl.kl_kind = "k3"
  c.rl.kl_in_reward = False
  # Policy-gradient loss: "ppo" (clipped surrogate; clip_high > clip_low is DAPO's clip-higher),
  # "gspo" (sequence ratio, clipped per sequence; pair with loss_agg="seq-mean-token-mean" and the
  # GSPO paper's clip range of 3e-4 / 4e-4), "cispo" (clipped ratio as a weight on logp).
  c.rl.policy_loss = "ppo"
  # Sampler/trainer mismatch correction: "none" | "token_tis" | "seq_tis" (truncated IS, capped at
  # is_cap) | "token_mask" | "seq_mask" | "geo_mask" (drop tokens / samples whose ratio leaves
  # [1/is_cap, is_cap]). mismatch/* metrics are logged every step, the drop shares at is_cap.
  c.rl.is_correction = "none"
  c.rl.is_cap = 2.0
  c.rl.logits_chunk = 1024

  c.rollout = ml_collections.ConfigDict()
  # KV cache rows of the policy and of the co-located simulator. 0 = one per dialogue of the step,
  # all in lockstep (each turn draws one key for the batch). R = at most R dialogues at once: an
  # ended dialogue's row goes at once to the next waiting group (continuous batching) and each
  # dialogue samples from its own key stream, so every R gives the same dialogues (greedy: those of
  # 0 too). rl.group_size <= R <= the step's dialogues (a group starts together).
  c.rollout.rows = 0
  # Decode layout of the policy's rollout copy (compute dtype, refreshed after each update):
  # 'auto' | 'train' | 'DATAxFSDPxTENSOR', as simulator.mesh.
  c.rollout.policy_mesh = "auto"

  c.optim = ml_collections.ConfigDict()
  c.optim.actor_lr = 1e-6
  c.optim.critic_lr = 5e-6
  # Linear warm-up from 0, then constant. Counted in optimizer updates (epochs x mini-batches per RL
  # step) or, as the reference does (its scheduler steps once per RL step), in RL steps.
  c.optim.warmup_unit = "updates"    # "updates" | "steps"
  c.optim.warmup_steps = 10          # actor
  c.optim.critic_warmup_steps = 10
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
  # SIGTERM: the last finished step is saved at once; its commit is awaited this long (a TPU VM's
  # preemption notice gives ~30 s), then the run exits either way (an older checkpoint is intact).
  c.checkpoint.preempt_deadline_s = 25.0

  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 50            # 0 = never
  c.eval.num_profiles = 20
  c.eval.start_emotion = 40
  c.eval.max_turns = 9              # policy replies: the opening + 9 replies = up to 10 user lines
  c.eval.end_below = 10              # the benchmark ends a dialogue in state F (emotion < 10)
  # The policy's system prompt in the held-out evaluation: "sage" (the benchmark's ask, in this
  # project's words), "chat_partner" (a generic one) or "training" (the one it is trained with).
  c.eval.policy_prompt = "sage"
  # Per policy turn, thought included; 0 = policy.max_new_tokens (the cap the policy trains at).
  c.eval.policy_max_new_tokens = 0
  # The simulator's information flow in this evaluation: "sage" (the benchmark's: the reference
  # flow whose reply step also reads the inner reaction; rlver_jax/env/info_flow.py), like
  # configs/eval_sentient.py, whatever simulator.info_flow training uses.
  c.eval.info_flow = "sage"
  # The held-out evaluation's change and goodbye rules (simulator.* hold training's); SAGE's are
  # True, 0 and "substring" (:reference, configs/eval_sentient.py).
  c.eval.clamp_change = True
  c.eval.state_change_range = 10
  c.eval.goodbye_match = "clause"
  # Policy sampling during held-out evaluation: the same as configs/eval_sentient.py (Qwen2.5-Instruct's
  # generation_config), so eval/score is comparable with `rlver_jax.evaluate`, not rollout sampling.
  c.eval.temperature = 0.7
  c.eval.top_p = 0.8
  c.eval.top_k = 20

  c.log = ml_collections.ConfigDict()
  c.log.transcripts_every = 10
  c.log.progress_bar = True
  # Weights & Biases (pip install 'rlver_jax[wandb]'): '' = off. The same scalars as TensorBoard,
  # the config, the reward plot and transcripts; WANDB_MODE=offline keeps the run under WANDB_DIR.
  c.log.wandb_project = ""
  c.log.wandb_entity = ""            # '' = the API key's default entity
  c.log.wandb_run_name = ""          # '' = a name W&B picks

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
