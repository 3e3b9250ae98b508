"""The run specs (training, the Sentient evaluation) and their one conversion from the ConfigDict."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, ClassVar, Mapping

from rlver_jax.env.rollout import RolloutConfig
from rlver_jax.parallel.sharding import MeshConfig
from rlver_jax.rl.algorithms import ALGORITHMS, Algorithm, algorithm_named
from rlver_jax.rl.update import LossConfig
from rlver_jax.spec.sections import (CheckpointSpec, ConfigError, CriticSpec, DataSpec,
                                     EvalRolloutSpec, EvalSpec, LogSpec, OptimSpec, PolicySpec, RolloutSpec,
                                     SimulatorSpec, require)
from rlver_jax.spec.rl_section import RLSpec


# Stands for --workdir in config.compile_cache_dir (run/compile_cache.py).
WORKDIR_PLACEHOLDER = "{workdir}"


def _check_compile_cache(setting) -> None:
  rest = setting.replace(WORKDIR_PLACEHOLDER, "") if isinstance(setting, str) else "{"
  require("compile_cache_dir", setting, "{" not in rest and "}" not in rest,
          f"a folder path ('' = none), in which {WORKDIR_PLACEHOLDER} stands for --workdir")


# -- ConfigDict -> sections ------------------------------------------------------------------------


def _plain(config: Mapping) -> dict:
  """A deep copy of the config as plain data (nested dicts); a ConfigDict gives its `to_dict()`."""
  if hasattr(config, "to_dict"):
    return config.to_dict()
  return copy.deepcopy(dict(config))


# Keys of earlier versions that were renamed: config key -> (the value that meant "off", the keys
# that say the same now). A saved config holding the "off" value still loads.
RENAMED = {"rl.tis_cap": (0.0, "config.rl.is_correction='token_tis' with config.rl.is_cap=C")}


def _section(default, tree: dict, key: str, strict: bool):
  """The section `default` (the spec's default instance of it) with tree[key]'s values: a missing
  key keeps the default; a key without a field is a ConfigError unless `strict` is False (a saved
  config of another version); a renamed key set to anything but its "off" value is a ConfigError
  naming the keys that replace it."""
  cls = type(default)
  values = dict(tree.get(key) or {})
  for name in [n for n in values if f"{key}.{n}" in RENAMED]:
    off, instead = RENAMED[f"{key}.{name}"]
    if values.pop(name) != off:
      raise ConfigError(f"config.{key}.{name} was removed: use {instead}")
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown and strict:
    raise ConfigError(f"config.{key}.{unknown[0]}: not a setting of the run spec "
                      f"({cls.__name__} has no such field)")
  values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names}
  return dataclasses.replace(default, **values)


def _defaults(cls) -> dict[str, Any]:
  """The spec's field defaults, by name (sections as their default instances)."""
  return {f.name: f.default for f in dataclasses.fields(cls) if f.name != "source"}


def _top_level(cls, tree: dict, strict: bool) -> dict:
  """The spec's fields from the tree: sections built by `_section`, plain keys copied. The tree's
  `kind` (written by `default_tree`, so every saved config.json says what it is) must be the spec's."""
  kind = tree.get("kind", cls.KIND)
  if kind != cls.KIND:
    raise ConfigError(f"config.kind={kind!r}: this is a {cls.KIND!r} setting (a {kind!r} config "
                      f"was given where {cls.__name__} is read)")
  defaults = _defaults(cls)
  names = set(defaults)
  unknown = sorted(set(tree) - names - {"kind"})
  if unknown and strict:
    raise ConfigError(f"config.{unknown[0]}: not a setting of the run spec ({cls.__name__} has no "
                      "such field)")
  out = {k: _section(defaults[k], tree, k, strict) for k in cls.SECTIONS}
  out.update({k: tree[k] for k in names - set(cls.SECTIONS) if k in tree})
  return out


def default_tree(cls) -> dict[str, Any]:
  """Every setting of spec class `cls` (RunSpec, EvaluationSpec) at its default, as the nested
  plain data a config file starts from, with the spec's `kind`: the one place defaults are declared."""
  tree: dict[str, Any] = {"kind": cls.KIND}
  for name, value in _defaults(cls).items():
    if name in cls.SECTIONS:
      value = {k: v for k, v in dataclasses.asdict(value).items()
               if f"{name}.{k}" not in cls.UNREAD}
    tree[name] = value
  return tree


def _rollout_config(policy: PolicySpec, rl: RLSpec, prompt: str, *, eval_mode: bool,
                    rows: int = 0, history_chars: int = 0, history_measure: str = "visible",
                    max_new_tokens: int = 0) -> RolloutConfig:
  return RolloutConfig(think=policy.think, keep_thoughts=policy.keep_thoughts,
                       max_new_tokens=max_new_tokens or policy.max_new_tokens,
                       temperature=policy.temperature,
                       top_p=policy.top_p, top_k=policy.top_k,
                       reward_mode="terminal" if eval_mode else rl.reward_mode,
                       format_penalty=False if eval_mode else rl.format_penalty,
                       language=policy.language or None,
                       system_prompt=prompt if eval_mode else "training",
                       training_prompt=policy.prompt,
                       share_prefix=rl.share_prefix, stop_sequences=policy.stop_sequences,
                       rows=rows, history_chars=0 if eval_mode else history_chars,
                       history_measure=history_measure, reply_cut=policy.reply_cut)


def _checkpoints(policy: PolicySpec, simulator: SimulatorSpec, critic: str = "") -> dict[str, str]:
  out = {"policy.checkpoint": policy.checkpoint}
  if critic:
    out["critic.checkpoint"] = critic
  if simulator.backend == "model":
    out["simulator.checkpoint"] = simulator.checkpoint
    if simulator.draft_checkpoint:
      out["simulator.draft_checkpoint"] = simulator.draft_checkpoint
  return out


# -- the run specs --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """A training run (configs/base.py). `source` is the config as plain data, for WORKDIR/config.json
  and the checkpoints' metadata; nothing reads settings from it."""
  SECTIONS: ClassVar[dict[str, type]] = {
      "policy": PolicySpec, "critic": CriticSpec, "simulator": SimulatorSpec, "data": DataSpec,
      "rl": RLSpec, "rollout": RolloutSpec, "optim": OptimSpec, "mesh": MeshConfig,
      "checkpoint": CheckpointSpec, "eval": EvalSpec, "log": LogSpec}
  KIND: ClassVar[str] = "training"
  UNREAD: ClassVar[frozenset[str]] = frozenset(["eval.batch_size"])  # keys training never reads

  algo: str = "grpo"  # "grpo" | "ppo"
  seed: int = 0
  total_steps: int = 1
  # JAX's persistent compilation cache, so a resumed or preempted run reads its compiled programs
  # back: beside the checkpoints ({workdir} = --workdir), where a run resumed on a new VM finds it;
  # '' = none (rlver_jax/run/compile_cache.py).
  compile_cache_dir: str = WORKDIR_PLACEHOLDER + "/compile_cache"
  policy: PolicySpec = PolicySpec()
  critic: CriticSpec = CriticSpec()
  simulator: SimulatorSpec = SimulatorSpec()
  data: DataSpec = DataSpec()
  rl: RLSpec = RLSpec()
  rollout: RolloutSpec = RolloutSpec()
  optim: OptimSpec = OptimSpec()
  mesh: MeshConfig = MeshConfig()
  checkpoint: CheckpointSpec = CheckpointSpec()
  eval: EvalSpec = EvalSpec()
  log: LogSpec = LogSpec()
  source: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @property
  def kind(self) -> str:
    """What the config is ("training"), as its config.json records it."""
    return self.KIND

  @classmethod
  def from_config(cls, config: Mapping, *, strict: bool = True) -> "RunSpec":
    """The spec of a training config; ConfigError names the first bad key. `strict=False` skips
    keys the spec does not know (a config.json saved by another version)."""
    tree = _plain(config)
    return cls(**_top_level(cls, tree, strict), source=tree)

  def __post_init__(self):
    _check_compile_cache(self.compile_cache_dir)
    if self.algo not in ALGORITHMS:
      raise ConfigError(f"config.algo: unknown algorithm {self.algo!r} (expected grpo or ppo)")
    # Zero would run nothing and end with a summary of outputs that were never written.
    require("total_steps", self.total_steps, self.total_steps >= 1,
            ">= 1 (the step the run trains up to, resumed steps included)")
    r, p = self.rl, self.policy
    problem = self.algorithm.config_problem(r)
    if problem:
      raise ConfigError(problem)
    # Each turn its own sample (think, thoughts dropped): a turn's sample earns the later turns'
    # reward undiscounted, which only equals the one-sequence return at gamma = 1.
    require("rl.gamma", r.gamma, r.gamma == 1 or not self.algorithm.has_critic or not p.think
            or p.keep_thoughts,
            "1 with policy.think=True and keep_thoughts=False (each turn is its own sample)")
    # A format penalty needs a format to check: only think mode asks for one.
    require("rl.format_penalty", r.format_penalty, not r.format_penalty or p.think,
            "False unless policy.think=True (no-think replies have no format to penalise)")
    # A group's dialogues start together (their shared opening is prefilled once and copied).
    rows, n = self.rollout.rows, r.dialogues_per_step
    require("rollout.rows", rows, rows == 0 or r.group_size <= rows <= n,
            f"0 (lockstep) or in [rl.group_size={r.group_size}, the step's {n} dialogues "
            "(rl.profiles_per_step x rl.group_size)]: a group's dialogues start together")
    if p.reshapes_sampling and r.correction[0] == "none":
      # The trainer's ratios use the model's own (T=1, untruncated) log-probs; samples drawn from a
      # reshaped distribution are off-policy unless a rollout correction accounts for it.
      raise ConfigError(f"config.policy sampling (temperature={p.temperature}, top_p={p.top_p}, "
                        f"top_k={p.top_k}) differs from the distribution being trained: use 1.0 / "
                        "1.0 / 0, or set config.rl.is_correction (e.g. 'token_tis' with "
                        "config.rl.is_cap=2.0) to correct for it")
    if self.evaluating:
      n = self.data.num_holdout
      require("data.num_holdout", n, n >= 1,
              ">= 1 when eval.every_steps > 0 (the evaluation runs on the held-out profiles)")
      require("eval.num_profiles", self.eval.num_profiles, self.eval.num_profiles <= n,
              f"in [0, data.num_holdout={n}] (0 = all held-out profiles)")

  @property
  def algorithm(self) -> Algorithm:
    return algorithm_named(self.algo, self.rl, self.critic.value_mask)

  @property
  def checkpoints(self) -> dict[str, str]:
    """Config key -> setting of every checkpoint the run reads (a critic only if it has one)."""
    critic = self.critic.checkpoint if self.algorithm.has_critic else ""
    return _checkpoints(self.policy, self.simulator, critic)

  @property
  def evaluating(self) -> bool:
    """Whether the run evaluates on its held-out profiles (every eval.every_steps steps)."""
    return self.eval.every_steps > 0

  def rollout_config(self) -> RolloutConfig:
    """The training rollout: the policy's sampling, the configured rewards."""
    return _rollout_config(self.policy, self.rl, "training", eval_mode=False,
                           rows=self.rollout.rows, history_chars=self.simulator.history_chars,
                           history_measure=self.simulator.history_measure)

  def holdout_rollout_config(self) -> RolloutConfig:
    """The held-out evaluation during training: eval sampling (config.eval), terminal rewards."""
    e = self.eval
    base = _rollout_config(self.policy, self.rl, e.policy_prompt, eval_mode=True,
                           rows=self.rollout.rows, max_new_tokens=e.policy_max_new_tokens)
    return dataclasses.replace(base, temperature=e.temperature, top_p=e.top_p, top_k=e.top_k)

  def loss_config(self) -> LossConfig:
    r = self.rl
    # Dr.GRPO's divisor is a constant of the run, not the packed length of each step's batch.
    return LossConfig(clip_low=r.clip_low, clip_high=r.clip_high, dual_clip=r.dual_clip or None,
                      agg=r.loss_agg, norm_len=r.loss_norm_len or self.policy.max_context,
                      chunks=r.loss_agg_chunks,
                      entropy_coef=r.entropy_coef, kl_coef=0.0 if r.kl_in_reward else r.kl_coef,
                      kl_kind=r.kl_kind, policy_loss=r.policy_loss,
                      is_correction=r.correction[0], is_cap=r.correction[1],
                      value_clip=r.value_clip or None, logits_chunk=r.logits_chunk)


@dataclasses.dataclass(frozen=True)
class EvaluationSpec:
  """A Sentient evaluation (configs/eval_sentient.py): the policy's own sampling, terminal rewards,
  the users of config.eval. `source` as in RunSpec."""
  SECTIONS: ClassVar[dict[str, type]] = {
      "policy": PolicySpec, "simulator": SimulatorSpec, "data": DataSpec, "eval": EvalSpec,
      "rollout": EvalRolloutSpec, "mesh": MeshConfig, "log": LogSpec}
  KIND: ClassVar[str] = "evaluation"
  # Training's keys an evaluation never reads, left out of its config (the users' game and change
  # rules are config.eval's; the policy's sampling and turn cap are policy.* and eval.*'s).
  UNREAD: ClassVar[frozenset[str]] = frozenset(
      ["policy.preset", "policy.max_new_tokens", "simulator.preset", "simulator.start_emotion",
       "simulator.max_turns", "simulator.end_below", "simulator.end_above",
       "simulator.clamp_change", "simulator.state_change_range", "simulator.goodbye_match",
       "simulator.info_flow", "simulator.history_chars", "simulator.history_measure",
       "simulator.max_failed_share", "data.num_holdout", "data.sampling", "eval.every_steps",
       "eval.temperature", "eval.top_p", "eval.top_k", "log.transcripts_every",
       "log.wandb_project", "log.wandb_entity", "log.wandb_run_name"])

  seed: int = 0
  compile_cache_dir: str = WORKDIR_PLACEHOLDER + "/compile_cache"  # as RunSpec's
  # Nothing trains: no fp32 master weights, no remat; room for a system prompt and 9 turns with
  # dropped thoughts; Qwen2.5-Instruct's own generation_config sampling.
  policy: PolicySpec = PolicySpec(param_dtype="bfloat16", remat="none", max_context=16384,
                                  temperature=0.7, top_p=0.8, top_k=20)
  # Persona and background, then ~1.3k tokens a turn for 9 turns.
  simulator: SimulatorSpec = SimulatorSpec(max_context=20480)
  data: DataSpec = DataSpec()
  # The benchmark's users: every profile of the file (num_profiles 0); a turn cap of SAGE's call
  # (none stated) at the reference's training cap; SAGE's change and goodbye rules: no range stated
  # to the simulator, the change clamped in code, 再见 / 拜拜 anywhere in the line.
  eval: EvalSpec = EvalSpec(num_profiles=0, policy_max_new_tokens=5000, state_change_range=0,
                            goodbye_match="substring")
  rollout: EvalRolloutSpec = EvalRolloutSpec()
  mesh: MeshConfig = MeshConfig()
  log: LogSpec = LogSpec()
  source: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @property
  def kind(self) -> str:
    """What the config is ("evaluation"), as its config.json records it."""
    return self.KIND

  @classmethod
  def from_config(cls, config: Mapping) -> "EvaluationSpec":
    tree = _plain(config)
    return cls(**_top_level(cls, tree, strict=True), source=tree)

  def __post_init__(self):
    _check_compile_cache(self.compile_cache_dir)
    # No training cap to fall back on: the evaluation states its own.
    n = self.eval.policy_max_new_tokens
    require("eval.policy_max_new_tokens", n, n >= 1, ">= 1 (the evaluation's cap per policy turn)")

  def rollout_config(self) -> RolloutConfig:
    return _rollout_config(self.policy, RLSpec(), self.eval.policy_prompt, eval_mode=True,
                           max_new_tokens=self.eval.policy_max_new_tokens)

  @property
  def checkpoints(self) -> dict[str, str]:
    """Config key -> setting of every checkpoint the evaluation reads."""
    out = _checkpoints(self.policy, self.simulator)
    if self.rollout.policy_draft_checkpoint:
      out["rollout.policy_draft_checkpoint"] = self.rollout.policy_draft_checkpoint
    return out
