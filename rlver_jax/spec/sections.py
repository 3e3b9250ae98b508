"""The spec's sections: one frozen dataclass per config section, one field per key, each checking
its own fields in `__post_init__` (ConfigError names the key)."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import Any

from rlver_jax.env.chat import GOODBYE_MATCHES, REPLY_CUTS, SYSTEM_PROMPTS, TRAINING_PROMPTS
from rlver_jax.env.info_flow import INFO_FLOWS
from rlver_jax.env.profiles import PROFILE_SAMPLINGS
from rlver_jax.env.rollout import HISTORY_MEASURES
from rlver_jax.env.expected_change import CHANGE_MODES
from rlver_jax.env.simulator_prompts import LANGUAGES, STYLES
from rlver_jax.env.user_rules import UserRules
from rlver_jax.env.user_state import end_below_need, start_emotion_need
from rlver_jax.models.quant import FORMATS
from rlver_jax.rl.prepare import VALUE_MASKS
from rlver_jax.rl.update import OptimConfig
from rlver_jax.sampling.strategies import sampling_needs

SIMULATOR_BACKENDS = ("model", "http", "scripted")


class ConfigError(ValueError):
  """A config value that cannot work; the message names the key."""


def require(key: str, value: Any, ok: bool, need: str) -> None:
  """Raises ConfigError `config.KEY=VALUE: must be NEED` unless `ok`."""
  if not ok:
    raise ConfigError(f"config.{key}={value!r}: must be {need}")


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _check_sampling(section: str, temperature: float, top_p: float, top_k: int) -> None:
  """The sampling ranges of every sampler (policy, held-out evaluation, simulator), as the sampler
  states them."""
  values = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
  for name, need in sampling_needs(temperature, top_p, top_k).items():
    require(f"{section}.{name}", values[name], False, need)


def _check_emotion(key: str, value: int) -> None:
  need = start_emotion_need(value)
  require(key, value, need is None, need)


def _check_end_below(key: str, value: int) -> None:
  need = end_below_need(value)
  require(key, value, need is None, need)


def _check_buckets(key: str, buckets: tuple) -> None:
  ok = (buckets and all(_is_int(b) and b > 0 for b in buckets)
        and list(buckets) == sorted(set(buckets)))
  if not ok:
    raise ConfigError(f"config.{key}={buckets!r}: must be strictly ascending positive token counts, "
                      "e.g. (16, 64, 256, 1024)")


def _check_windows(section: str, decode_segment, window_step) -> None:
  for key, value in (("decode_segment", decode_segment), ("window_step", window_step)):
    require(f"{section}.{key}", value, _is_int(value) and value >= 0,
            "an integer >= 0 (0 = one decode call per turn / power-of-two windows)")


# -- the sections ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicySpec:
  """config.policy: the trained (or evaluated) model and how it samples."""
  # HF safetensors directory (local or gs://), or a Hub id ORG/NAME[@REV] (docs/OPTIONS.md)
  checkpoint: str = "embedded"
  # Architecture preset for `python -m rlver_jax.aot` only (it compiles without reading checkpoints);
  # training reads the architecture from the checkpoint. "NAME:L" keeps NAME's widths with L layers.
  preset: str = ""
  param_dtype: str = "float32"  # fp32 master weights
  compute_dtype: str = "bfloat16"
  remat: str = "full"
  max_context: int = 8192  # KV cache slots per dialogue (all turns)
  # Appended token counts are padded up to one of these (one compiled program each); the largest is
  # also the chunk a long prefill is cut into. Policy appends: user turns (~16-64 tokens), prefills.
  append_buckets: tuple[int, ...] = (16, 64, 256, 1024)
  # A decode runs in calls of decode_segment tokens, each attending a window just past what its rows
  # can reach: powers of two up to window_step, then its multiples (one compiled program each).
  # Cost follows the filled cache (~1.05x) instead of the next power of two above it plus the whole
  # budget (~1.3x); 0 and 0 = one call a turn, power-of-two windows (sampling/sampler.py).
  decode_segment: int = 128
  window_step: int = 1024
  think: bool = False
  keep_thoughts: bool = False  # think mode: earlier thoughts are dropped from later turns
  max_new_tokens: int = 1024  # per turn (the reference allows 5,000)
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  language: str = ""  # system prompt language; "" = each profile's own
  # Strings that end a policy turn inside the decode loop besides <|im_end|> (e.g. "<|im_start|>"
  # for a model that opens the next turn itself); () = none.
  stop_sequences: tuple[str, ...] = ()
  # The training system prompt: "project" (this project's: the user's ease and trust, a thought on
  # what they want and feel, the reply's form) or "reference" (the released RLVER prompts' meaning:
  # an emotionally intelligent friend, a thought on reply strategy), both in this project's words.
  prompt: str = "project"
  # What of a reply the user sees: "label" (the text after </think> less one leading speaker
  # label such as "Assistant:") or "reference" (the RLVER reference's: think mode keeps the text
  # after the last 你：/你:, no-think mode the text as it is).
  reply_cut: str = "label"

  def __post_init__(self):
    require("policy.prompt", self.prompt, self.prompt in TRAINING_PROMPTS,
            f"one of {TRAINING_PROMPTS}")
    require("policy.reply_cut", self.reply_cut, self.reply_cut in REPLY_CUTS, f"one of {REPLY_CUTS}")
    require("policy.language", self.language, self.language in ("",) + LANGUAGES,
            f"'' (each profile's own) or one of {LANGUAGES}")
    require("policy.stop_sequences", self.stop_sequences,
            isinstance(self.stop_sequences, tuple)
            and all(isinstance(s, str) and s for s in self.stop_sequences),
            "a tuple of non-empty strings")
    _check_sampling("policy", self.temperature, self.top_p, self.top_k)
    _check_buckets("policy.append_buckets", self.append_buckets)
    _check_windows("policy", self.decode_segment, self.window_step)

  @property
  def reshapes_sampling(self) -> bool:
    """Whether samples come from another distribution than the model's own (T=1, untruncated)."""
    return self.temperature != 1.0 or self.top_p != 1.0 or self.top_k != 0


HEAD_INITS = ("zeros", "normal")


@dataclasses.dataclass(frozen=True)
class CriticSpec:
  """config.critic (PPO): "" starts the critic from the policy checkpoint plus a new value head;
  which tokens its loss trains on (`rl.prepare.VALUE_MASKS`) and how the head starts ("normal":
  the reference's, N(0, initializer_range of the checkpoint's config))."""
  checkpoint: str = ""  # "" = initialise from the policy checkpoint + a new value head
  # The critic's loss trains on "policy_tokens" or "reference" (the reference's: from the first
  # policy token through the position after the sample's end, user tokens inside included).
  value_mask: str = "policy_tokens"
  head_init: str = "zeros"  # the new value head: "zeros" | "normal" (N(0, 0.02), the reference's)

  def __post_init__(self):
    require("critic.value_mask", self.value_mask, self.value_mask in VALUE_MASKS,
            f"one of {VALUE_MASKS}")
    require("critic.head_init", self.head_init, self.head_init in HEAD_INITS, f"one of {HEAD_INITS}")


@dataclasses.dataclass(frozen=True)
class SimulatorSpec:
  """config.simulator: the simulated user (its model or server, sampling, dialogue rules)."""
  backend: str = "model"  # "model" (co-located) | "http" | "scripted"
  checkpoint: str = "embedded"
  preset: str = ""  # for rlver_jax.aot only, like policy.preset
  dtype: str = "bfloat16"
  # The frozen simulator's storage: "bf16" = as simulator.dtype; "int8" = symmetric int8 with a
  # scale per output channel (weights) or per token and KV head (KV cache): half the bytes that its
  # memory-bound decode reads (fidelity: README, benchmarks/int8_fidelity.py).
  weight_dtype: str = "bf16"
  kv_dtype: str = "bf16"  # "int8": KV cache in int8 with a scale per token and KV head
  style: str = "vanilla"
  # KV slots per dialogue. The 'reference' flow keeps a clean transcript (profile, every visible
  # line) plus one step's request and answer; 'chat' keeps every analysis and plan too (~16384).
  max_context: int = 8192
  # Simulator appends are a policy reply plus an instruction, ~150-700 tokens: finer buckets there.
  append_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024)
  decode_segment: int = 128  # as policy.decode_segment / window_step
  window_step: int = 1024
  max_new_tokens: int = 512
  temperature: float = 0.7
  top_p: float = 0.9
  top_k: int = 0
  start_emotion: int = 30
  # Policy replies per dialogue. The reference's limit of 8 is checked after the user's reply, so its
  # training dialogues hold 9 policy replies; this counts them directly.
  max_turns: int = 9
  end_below: int = 1  # a dialogue ends when the emotion falls below this (1: at 0)
  clamp_change: bool = True  # each stated change limited to [-10, 10] (as the benchmark)
  score_guidance: bool = False  # no "+3 to +10 for a good reply" scale (the reference has none)
  # What the simulator's steps see of each other: "reference" = the paper's: the emotion step sees a
  # clean transcript, the reply step only the fit/feeling notes and the state label, each step's
  # private answer rewound out of the cache once read (rlver_jax/env/info_flow.py); "chat" = one
  # growing chat (every later step sees the earlier analyses and plans; this project's runs before
  # 2026-12-07).
  info_flow: str = "reference"
  # "sampled": the change the simulator wrote; "expected": the mean of its own distribution over
  # -10..+10 where it wrote the value (model backend only; emotions become floats; see
  # rlver_jax/env/expected_change.py). The held-out evaluation keeps "sampled" (the benchmark's rule).
  change_mode: str = "sampled"
  max_parse_retries: int = 2  # re-asks of an unreadable change line and of a missing reply line
  http_base_url: str = ""
  http_model: str = ""
  http_api_key_env: str = "OPENAI_API_KEY"
  http_timeout_s: float = 120.0  # per connect / read
  http_deadline_s: float = 300.0  # per attempt, connect to last byte (a trickling server)
  http_max_attempts: int = 4
  http_max_concurrency: int = 8
  # A dialogue whose simulator request fails within its attempts ends as simulator_error (not
  # trained); a step with a larger share of those stops the run (after saving the last step).
  max_failed_share: float = 0.5
  # Model backend: end each decode on device right after its change line (emotion step) or reply
  # line (reply step, opening) instead of decoding the text after it (env/answer_stops.py). Off:
  # the parser reads the last label of a whole answer, so a model writing more labelled lines
  # after the first could get another result.
  stop_at_lines: bool = False
  # The emotion prompt (and its retry) asks for a change in [-N, N]; 0 states no range.
  state_change_range: int = 10
  # A dialogue also ends when the emotion reaches this (0: never; the user still leaves on a goodbye
  # or at 0).
  end_above: int = 100
  # Goodbye detection: "clause" (再见/拜拜 ending a clause, not negated; English farewells) or
  # "substring" (再见, 拜拜 or "bye" anywhere in the line).
  goodbye_match: str = "clause"
  # Training ends a dialogue whose history passes this many characters; 0 = no limit (the policy's
  # cache still bounds it: context_full).
  history_chars: int = 0
  # What history_chars counts: "visible" (the user's and the policy's lines) or "rendered" (the
  # policy's prompt as the chat template renders it: system prompt, role tags and the lines, as the
  # reference counts).
  history_measure: str = "visible"
  # Decode layout of the frozen simulator over the same devices as config.mesh
  # (rlver_jax/spec/layouts.py): 'auto' (tensor parallel over heads, data over cache rows),
  # 'train' (config.mesh) or 'DATAxFSDPxTENSOR' such as '4x1x8'.
  mesh: str = "auto"
  # Speculative decoding (model backend; sampling/speculative.py): a small model of the same
  # vocabulary proposes draft_tokens tokens per row and the simulator keeps its longest valid
  # prefix in one pass, so answers follow the simulator's own distribution (greedy: its own tokens).
  # '' = off; else a checkpoint like simulator.checkpoint (HF directory, gs:// path, Hub id).
  draft_checkpoint: str = ""
  draft_tokens: int = 4  # proposals per verify pass (k)
  draft_mesh: str = "auto"  # the draft's decode layout on the same devices, as simulator.mesh

  def __post_init__(self):
    self._check_reference_rules()
    check_layout("simulator.mesh", self.mesh)
    self._check_draft()
    require("simulator.stop_at_lines", self.stop_at_lines, isinstance(self.stop_at_lines, bool),
            "True or False")
    require("simulator.backend", self.backend, self.backend in SIMULATOR_BACKENDS,
            f"one of {SIMULATOR_BACKENDS}")
    require("simulator.style", self.style, self.style in STYLES, f"one of {STYLES}")
    for key in ("weight_dtype", "kv_dtype"):
      value = getattr(self, key)
      require(f"simulator.{key}", value, value in FORMATS,
              f"one of {FORMATS} ('bf16': unquantized, in simulator.dtype)")
    require("simulator.info_flow", self.info_flow, self.info_flow in INFO_FLOWS,
            f"one of {INFO_FLOWS}")
    require("simulator.change_mode", self.change_mode, self.change_mode in CHANGE_MODES,
            f"one of {CHANGE_MODES}")
    require("simulator.change_mode", self.change_mode,
            self.change_mode == "sampled" or self.backend == "model",
            f"'sampled' with simulator.backend={self.backend!r} (only the co-located model "
            "backend gives a distribution over the change values)")
    require("simulator.max_turns", self.max_turns, self.max_turns >= 1, ">= 1")
    _check_end_below("simulator.end_below", self.end_below)
    require("simulator.max_parse_retries", self.max_parse_retries, self.max_parse_retries >= 0,
            ">= 0")
    require("simulator.max_failed_share", self.max_failed_share, 0 <= self.max_failed_share <= 1,
            "in [0, 1]")
    require("simulator.http_deadline_s", self.http_deadline_s, self.http_deadline_s > 0, "> 0")
    _check_emotion("simulator.start_emotion", self.start_emotion)
    _check_sampling("simulator", self.temperature, self.top_p, self.top_k)
    _check_buckets("simulator.append_buckets", self.append_buckets)
    _check_windows("simulator", self.decode_segment, self.window_step)
    if self.backend == "http":
      if not self.http_base_url or not self.http_model:
        raise ConfigError("config.simulator.http_base_url and config.simulator.http_model are "
                          "required for the http simulator backend")
      # OpenAI-style chat APIs take temperature and top_p only.
      require("simulator.top_k", self.top_k, self.top_k == 0,
              "0 with simulator.backend='http' (the chat API has no top_k)")

  def _check_draft(self) -> None:
    d = self.draft_checkpoint
    require("simulator.draft_checkpoint", d, isinstance(d, str),
            "a string ('' = off; a checkpoint like simulator.checkpoint)")
    require("simulator.draft_tokens", self.draft_tokens,
            _is_int(self.draft_tokens) and self.draft_tokens >= 1, "an integer >= 1")
    check_layout("simulator.draft_mesh", self.draft_mesh)
    if not d:
      return
    require("simulator.draft_checkpoint", d, self.backend == "model",
            f"'' with simulator.backend={self.backend!r} (a draft serves the co-located model only)")

  def _check_reference_rules(self) -> None:
    r = self.state_change_range
    require("simulator.state_change_range", r, _is_int(r) and r >= 0,
            "an int >= 0 (the prompt states [-N, N]; 0 = no range stated)")
    require("simulator.end_above", self.end_above, _is_int(self.end_above)
            and 0 <= self.end_above <= 100, "in [0, 100] (0 = never end on a high emotion)")
    require("simulator.goodbye_match", self.goodbye_match, self.goodbye_match in GOODBYE_MATCHES,
            f"one of {GOODBYE_MATCHES}")
    require("simulator.history_chars", self.history_chars, _is_int(self.history_chars)
            and self.history_chars >= 0, "an int >= 0 (0 = no limit)")
    require("simulator.history_measure", self.history_measure,
            self.history_measure in HISTORY_MEASURES, f"one of {HISTORY_MEASURES}")

  def user_rules(self, users: "EvalSpec | None" = None) -> UserRules:
    """The simulated users' rules: training's, or with `users` an evaluation's (its start emotion,
    turn limit, information flow, change rules and goodbye detection, and an end at 100; the style
    and the simulator's other settings stay this section's)."""
    game = users or self
    return UserRules(style=self.style, start_emotion=game.start_emotion, max_turns=game.max_turns,
                     max_parse_retries=self.max_parse_retries, end_below=game.end_below,
                     clamp_change=game.clamp_change, score_guidance=self.score_guidance,
                     info_flow=game.info_flow, change_mode=self.change_mode,
                     change_range=game.state_change_range,
                     end_above=100 if users else self.end_above, goodbye_match=game.goodbye_match)


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """config.data: the profile file (or a shipped demo set) and the held-out share."""
  profiles: str = "demo"
  num_holdout: int = 20  # held out from training for periodic evaluation
  # "epochs": each profile once per shuffled epoch; "with_replacement": independent uniform draws.
  sampling: str = "epochs"

  def __post_init__(self):
    require("data.sampling", self.sampling, self.sampling in PROFILE_SAMPLINGS,
            f"one of {PROFILE_SAMPLINGS}")


_LAYOUT = re.compile(r"^(-1|\d+)x(-1|\d+)x(-1|\d+)$")


def check_layout(key: str, value) -> None:
  """A decode layout setting: 'train', 'auto' or 'DATAxFSDPxTENSOR' (rlver_jax/spec/layouts.py)."""
  if not isinstance(value, str) or not (value in ("train", "auto") or _LAYOUT.match(value)):
    raise ConfigError(f"config.{key}={value!r}: expected 'auto', 'train' or sizes "
                      "'DATAxFSDPxTENSOR' such as '4x1x8'")
  if value not in ("train", "auto"):
    sizes = [int(s) for s in value.split("x")]
    if sizes.count(-1) > 1 or 0 in sizes:
      raise ConfigError(f"config.{key}={value!r}: sizes must be >= 1, at most one of them -1")


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  """config.rollout: how a step's dialogues share the samplers' KV cache rows."""
  # KV cache rows of the policy and of the co-located simulator. 0 = one per dialogue of the step,
  # all in lockstep (each turn draws one key for the batch). R = at most R dialogues at once: an
  # ended dialogue's row goes at once to the next waiting group (continuous batching) and each
  # dialogue samples from its own key stream, so every R gives the same dialogues (greedy: those of
  # 0 too). rl.group_size <= R <= the step's dialogues (a group starts together).
  rows: int = 0
  # Decode layout of the policy's rollout copy (compute dtype, refreshed after each update):
  # 'auto' | 'train' | 'DATAxFSDPxTENSOR', as simulator.mesh.
  policy_mesh: str = "auto"

  def __post_init__(self):
    check_layout("rollout.policy_mesh", self.policy_mesh)
    require("rollout.rows", self.rows, _is_int(self.rows) and self.rows >= 0,
            "an integer >= 0 (0 = a cache row for every dialogue of the step)")


@dataclasses.dataclass(frozen=True)
class EvalRolloutSpec:
  """config.rollout of an evaluation: the policy's decode layout (it loads straight into it), and a
  draft for its decode."""
  policy_mesh: str = "auto"
  # Speculative decoding of the frozen policy (sampling/drafted.py), as simulator.draft_checkpoint:
  # a small model of the policy's vocabulary proposes policy_draft_tokens tokens a verify pass, and
  # the replies follow the policy's own distribution (greedy: its own tokens). '' = off; else a
  # checkpoint like policy.checkpoint.
  policy_draft_checkpoint: str = ""
  policy_draft_tokens: int = 4
  policy_draft_mesh: str = "auto"  # the draft's decode layout on the same devices

  def __post_init__(self):
    check_layout("rollout.policy_mesh", self.policy_mesh)
    require("rollout.policy_draft_checkpoint", self.policy_draft_checkpoint,
            isinstance(self.policy_draft_checkpoint, str),
            "a string ('' = off; a checkpoint like policy.checkpoint)")
    require("rollout.policy_draft_tokens", self.policy_draft_tokens,
            _is_int(self.policy_draft_tokens) and self.policy_draft_tokens >= 1, "an integer >= 1")
    check_layout("rollout.policy_draft_mesh", self.policy_draft_mesh)


@dataclasses.dataclass(frozen=True)
class OptimSpec:
  """config.optim: AdamW for the actor and the critic, with a linear warm-up."""
  actor_lr: float = 1e-6
  critic_lr: float = 5e-6
  # Linear warm-up from 0, then constant. Counted in optimizer updates (epochs x mini-batches per RL
  # step) or, as the reference does (its scheduler steps once per RL step), in RL steps.
  warmup_unit: str = "updates"  # "updates" | "steps"
  warmup_steps: int = 10  # actor
  critic_warmup_steps: int = 10
  b1: float = 0.9
  b2: float = 0.999
  weight_decay: float = 0.01
  grad_clip: float = 1.0  # global-norm clip; 0 = off

  def __post_init__(self):
    require("optim.actor_lr", self.actor_lr, self.actor_lr > 0, "> 0")
    require("optim.critic_lr", self.critic_lr, self.critic_lr > 0, "> 0")
    require("optim.warmup_steps", self.warmup_steps, self.warmup_steps >= 0, ">= 0")
    require("optim.critic_warmup_steps", self.critic_warmup_steps, self.critic_warmup_steps >= 0,
            ">= 0")
    require("optim.warmup_unit", self.warmup_unit, self.warmup_unit in ("updates", "steps"),
            "'updates' or 'steps' (RL steps)")
    require("optim.b1", self.b1, 0 <= self.b1 < 1, "in [0, 1)")
    require("optim.b2", self.b2, 0 <= self.b2 < 1, "in [0, 1)")
    require("optim.weight_decay", self.weight_decay, self.weight_decay >= 0, ">= 0")
    require("optim.grad_clip", self.grad_clip, self.grad_clip >= 0, ">= 0 (0 = off)")

  def warmup(self, critic: bool = False) -> int:
    return self.critic_warmup_steps if critic else self.warmup_steps

  def optim_config(self, critic: bool = False) -> OptimConfig:
    """The optimizer's own schedule counts updates; a warm-up in RL steps is applied by the trainer
    (`Updater.step(lr_scale=...)`), so the optimizer then runs at a constant rate."""
    warmup = self.warmup(critic) if self.warmup_unit == "updates" else 0
    return OptimConfig(learning_rate=self.critic_lr if critic else self.actor_lr,
                       warmup_steps=warmup, b1=self.b1, b2=self.b2,
                       weight_decay=self.weight_decay, grad_clip=self.grad_clip)


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
  """config.checkpoint: how often to save, how many to keep, the grace for a save on SIGTERM."""
  every_steps: int = 10
  keep: int = 3
  # SIGTERM: the last finished step is saved at once; its commit is awaited this long (a TPU VM's
  # preemption notice gives ~30 s), then the run exits either way (an older checkpoint is intact).
  preempt_deadline_s: float = 25.0

  def __post_init__(self):
    require("checkpoint.every_steps", self.every_steps, self.every_steps >= 0,
            ">= 0 (0 = at the end and on preemption only)")
    require("checkpoint.keep", self.keep, self.keep >= 1, ">= 1")
    require("checkpoint.preempt_deadline_s", self.preempt_deadline_s, self.preempt_deadline_s > 0,
            "> 0")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """config.eval: the held-out evaluation during training, or the Sentient evaluation's users.
  (`every_steps` and the sampling are training's; `batch_size` is the Sentient evaluation's.)"""
  every_steps: int = 50  # 0 = never
  num_profiles: int = 20  # 0 = all
  start_emotion: int = 40
  max_turns: int = 9  # policy replies: the opening + 9 replies = up to 10 user lines
  end_below: int = 10  # the benchmark ends a dialogue in state F (emotion < 10)
  # The policy's system prompt in the held-out evaluation: "sage" (the benchmark's ask, in this
  # project's words), "chat_partner" (a generic one) or "training" (the one it is trained with).
  policy_prompt: str = "sage"
  # Policy sampling during held-out evaluation: the same as configs/eval_sentient.py (Qwen2.5-Instruct's
  # generation_config), so eval/score is comparable with `rlver_jax.evaluate`, not rollout sampling.
  temperature: float = 0.7
  top_p: float = 0.8
  top_k: int = 20
  batch_size: int = 32
  # Per policy turn, thought included; 0 = policy.max_new_tokens (the cap the policy trains at).
  policy_max_new_tokens: int = 0
  # The simulator's information flow in this evaluation: "sage" (the benchmark's: the reference
  # flow whose reply step also reads the inner reaction; rlver_jax/env/info_flow.py), like
  # configs/eval_sentient.py, whatever simulator.info_flow training uses.
  info_flow: str = "sage"
  # The held-out evaluation's change and goodbye rules (simulator.* hold training's); SAGE's are
  # True, 0 and "substring" (:reference, configs/eval_sentient.py).
  clamp_change: bool = True
  state_change_range: int = 10
  goodbye_match: str = "clause"

  def __post_init__(self):
    r = self.state_change_range
    require("eval.state_change_range", r, _is_int(r) and r >= 0,
            "an int >= 0 (the prompt states [-N, N]; 0 = no range stated)")
    require("eval.goodbye_match", self.goodbye_match, self.goodbye_match in GOODBYE_MATCHES,
            f"one of {GOODBYE_MATCHES}")
    n = self.policy_max_new_tokens
    require("eval.policy_max_new_tokens", n, _is_int(n) and n >= 0,
            "an int >= 0 (0 = policy.max_new_tokens, the training cap)")
    require("eval.info_flow", self.info_flow, self.info_flow in INFO_FLOWS, f"one of {INFO_FLOWS}")
    require("eval.every_steps", self.every_steps, self.every_steps >= 0, ">= 0 (0 = never)")
    require("eval.num_profiles", self.num_profiles, self.num_profiles >= 0, ">= 0 (0 = all)")
    require("eval.max_turns", self.max_turns, self.max_turns >= 1, ">= 1")
    _check_end_below("eval.end_below", self.end_below)
    require("eval.policy_prompt", self.policy_prompt, self.policy_prompt in SYSTEM_PROMPTS,
            f"one of {SYSTEM_PROMPTS}")
    _check_emotion("eval.start_emotion", self.start_emotion)
    _check_sampling("eval", self.temperature, self.top_p, self.top_k)
    require("eval.batch_size", self.batch_size, self.batch_size >= 1, ">= 1")


@dataclasses.dataclass(frozen=True)
class LogSpec:
  """config.log: transcripts (every N steps; 0 = never), the progress bar, W&B ('' = off)."""
  transcripts_every: int = 10
  progress_bar: bool = True
  # Weights & Biases (pip install 'rlver_jax[wandb]'): '' = off. The same scalars as TensorBoard,
  # the config, the reward plot and transcripts; WANDB_MODE=offline keeps the run under WANDB_DIR.
  wandb_project: str = ""
  wandb_entity: str = ""  # '' = the API key's default entity
  wandb_run_name: str = ""  # '' = a name W&B picks

  def __post_init__(self):  # before any model loads; find_spec does not import wandb
    require("log.wandb_project", self.wandb_project, not self.wandb_project or
            importlib.util.find_spec("wandb"), "'' without wandb (pip install 'rlver_jax[wandb]')")
