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

Every setting that changes results is an explicit value below: policy and simulator sampling, the
start emotion, the turn budget, the simulator style and the prompts' language (profiles' own).
"""
from __future__ import annotations

import ml_collections

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
  args = _parse_arg(arg)
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.compile_cache_dir = "{workdir}/compile_cache"  # see configs/base.py; '' = none

  c.policy = ml_collections.ConfigDict()
  c.policy.checkpoint = "gs://YOUR_BUCKET/models/Qwen2.5-7B-Instruct"  # HF safetensors directory
  c.policy.param_dtype = "bfloat16"  # no training: no fp32 master weights
  c.policy.compute_dtype = "bfloat16"
  c.policy.remat = "none"
  c.policy.max_context = 16384       # KV slots per dialogue: system prompt + 9 turns, thoughts dropped
  c.policy.append_buckets = (16, 64, 256, 1024)  # padded append lengths (see configs/base.py)
  c.policy.decode_segment = 128      # decode calls and their windows (see configs/base.py)
  c.policy.window_step = 1024
  c.policy.think = args.get("think", "true") == "true"
  c.policy.keep_thoughts = False     # think mode: earlier thoughts are dropped from later turns
  # The training prompt, for eval.policy_prompt="training" ("project" | "reference", configs/base.py).
  c.policy.prompt = "project"
  # What of a reply the user sees: "label" (less a leading speaker label) or "reference" (see
  # configs/base.py).
  c.policy.reply_cut = "label"
  # Qwen2.5-Instruct's own generation_config sampling.
  c.policy.temperature = 0.7
  c.policy.top_p = 0.8
  c.policy.top_k = 20
  c.policy.language = ""             # policy system prompt language; "" = each profile's own

  c.simulator = ml_collections.ConfigDict()
  c.simulator.backend = "model"      # "model" (co-located) | "http" | "scripted"
  c.simulator.checkpoint = "gs://YOUR_BUCKET/models/Qwen2.5-72B-Instruct"
  c.simulator.dtype = "bfloat16"
  # The frozen simulator's storage: "bf16" = as simulator.dtype; "int8" = symmetric int8 with a
  # scale per output channel (weights) or per token and KV head (KV cache): half the bytes that its
  # memory-bound decode reads (fidelity: README, benchmarks/int8_fidelity.py).
  c.simulator.weight_dtype = "bf16"
  c.simulator.kv_dtype = "bf16"
  c.simulator.style = args.get("simulator", "vanilla")
  c.simulator.max_context = 20480    # persona + background, then ~1.3k tokens per turn for 9 turns
  c.simulator.append_buckets = (64, 128, 256, 512, 1024)
  c.simulator.decode_segment = 128
  c.simulator.window_step = 1024
  c.simulator.max_new_tokens = 512
  c.simulator.temperature = 0.7
  c.simulator.top_p = 0.9
  c.simulator.top_k = 0
  c.simulator.max_parse_retries = 2
  c.simulator.score_guidance = False  # no points scale in the prompt (the reference states none)
  c.simulator.change_mode = "sampled"  # "expected": the simulator's mean change (model backend only)
  c.simulator.http_base_url = ""
  c.simulator.http_model = ""
  c.simulator.http_api_key_env = "OPENAI_API_KEY"
  c.simulator.http_timeout_s = 120.0     # per connect / read
  c.simulator.http_deadline_s = 300.0    # per attempt, connect to last byte (a trickling server)
  c.simulator.http_max_attempts = 4
  c.simulator.http_max_concurrency = 8

  c.data = ml_collections.ConfigDict()
  c.data.profiles = "gs://YOUR_BUCKET/data/sentient_profiles.jsonl"  # the 100 Sentient profiles

  c.eval = ml_collections.ConfigDict()
  c.eval.num_profiles = 0            # the first N profiles of the file; 0 = all
  c.eval.start_emotion = 40
  c.eval.max_turns = 9               # policy replies = scored emotion updates (see the docstring)
  c.eval.end_below = 10              # the benchmark's failure state F ends a dialogue
  # "sage": the benchmark's ask (a partner with high emotional intelligence who makes the user feel
  # better); "chat_partner": a generic "chat naturally" prompt; "training": the training prompt.
  c.eval.policy_prompt = "sage"
  c.eval.batch_size = 32             # dialogues run together
  # Per policy turn, thought included: the reference's training cap, so a policy trained under
  # :reference is never cut here (SAGE states no cap); a turn that ends sooner costs nothing more.
  c.eval.policy_max_new_tokens = 5000
  # What the simulator's steps see: "sage" (the benchmark's: a clean transcript, the reply step
  # reads the fit, inner-reaction and feeling notes), "reference" (training's: fit and feeling) or
  # "chat" (one growing chat; this project's evaluations before 2026-12-04).
  c.eval.info_flow = "sage"
  # SAGE's rules: each change clamped to [-10, 10] in code, no range stated to the simulator (N:
  # the prompt asks for [-N, N]), and a dialogue ends on 再见 / 拜拜 anywhere in the user's line
  # ("substring"; "clause": only a farewell said at a clause end, not negated).
  c.eval.clamp_change = True
  c.eval.state_change_range = 0
  c.eval.goodbye_match = "substring"

  # Nothing trains: the policy and the simulator each load straight into their decode layout over
  # the mesh's devices (rlver_jax/spec/layouts.py): 'auto' (tensor parallel over heads, data over
  # cache rows), 'train' (config.mesh) or 'DATAxFSDPxTENSOR' such as '4x1x8'.
  c.rollout = ml_collections.ConfigDict()
  c.rollout.policy_mesh = "auto"
  c.simulator.mesh = "auto"

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1

  c.log = ml_collections.ConfigDict()
  c.log.progress_bar = True

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
