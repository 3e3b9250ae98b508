"""The run spec: every key of the shipped configs has a spec field and comes through unchanged, a
key without a field is refused, and each section's check names its key."""
import dataclasses
import importlib.util
import pathlib

import pytest

from rlver_jax import spec as spec_lib
from rlver_jax.rl.algorithms import GRPO, PPO
from rlver_jax.spec import ConfigError, EvaluationSpec, RunSpec

REPO = pathlib.Path(__file__).resolve().parents[2]


def _config(name, arg=None):
  module_spec = importlib.util.spec_from_file_location(f"spec_test_{name}",
                                                       REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if name != "base" else module.get_base_config("grpo", False, arg)


def _leaves(tree, prefix=""):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _leaves(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}", v


def _get(spec, key):
  node = spec
  for part in key.split("."):
    node = getattr(node, part)
  return node


@pytest.mark.parametrize("name,arg,cls", [
    ("base", None, RunSpec), ("base", "runlocal", RunSpec), ("base", "reference", RunSpec),
    ("grpo_think", None, RunSpec), ("ppo_think", None, RunSpec), ("ppo_nothink", "runlocal", RunSpec),
    ("demo", None, RunSpec), ("eval_sentient", None, EvaluationSpec),
    ("eval_sentient", "runlocal", EvaluationSpec)])
def test_every_config_key_round_trips(name, arg, cls):
  config = _config(name, arg)
  spec = cls.from_config(config)
  leaves = dict(_leaves(config.to_dict()))
  assert leaves  # a key added to a config without a spec field fails from_config above
  for key, value in leaves.items():
    got = _get(spec, key)
    assert got == (tuple(value) if isinstance(value, list) else value), key
    assert type(got) is type(value) or isinstance(value, (list, tuple)), key
  assert spec.source == config.to_dict()


def test_a_key_without_a_spec_field_is_refused():
  config = _config("base").to_dict()
  config["rl"]["clip_lo"] = 0.2
  with pytest.raises(ConfigError, match=r"config\.rl\.clip_lo: not a setting"):
    RunSpec.from_config(config)
  config = _config("base").to_dict()
  config["epochs"] = 2
  with pytest.raises(ConfigError, match=r"config\.epochs: not a setting"):
    RunSpec.from_config(config)
  RunSpec.from_config(dict(config), strict=False)  # a saved config of another version


def test_the_spec_is_frozen():
  spec = RunSpec.from_config(_config("base"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.rl.clip_low = 0.3


# (section class, field, bad value, key named in the message)
_BAD = [
    (spec_lib.PolicySpec, "language", "fr", "policy.language"),
    (spec_lib.PolicySpec, "temperature", -1.0, "policy.temperature"),
    (spec_lib.PolicySpec, "top_p", 0.0, "policy.top_p"),
    (spec_lib.PolicySpec, "top_k", 1.5, "policy.top_k"),
    (spec_lib.PolicySpec, "append_buckets", (64, 16), "policy.append_buckets"),
    (spec_lib.SimulatorSpec, "backend", "grpc", "simulator.backend"),
    (spec_lib.SimulatorSpec, "style", "grumpy", "simulator.style"),
    (spec_lib.SimulatorSpec, "weight_dtype", "fp8", "simulator.weight_dtype"),
    (spec_lib.SimulatorSpec, "kv_dtype", "int4", "simulator.kv_dtype"),
    (spec_lib.SimulatorSpec, "info_flow", "plain", "simulator.info_flow"),
    (spec_lib.SimulatorSpec, "start_emotion", 120, "simulator.start_emotion"),
    (spec_lib.SimulatorSpec, "max_turns", 0, "simulator.max_turns"),
    (spec_lib.SimulatorSpec, "end_below", 0, "simulator.end_below"),
    (spec_lib.SimulatorSpec, "max_failed_share", 1.5, "simulator.max_failed_share"),
    (spec_lib.SimulatorSpec, "stop_at_lines", "yes", "simulator.stop_at_lines"),
    (spec_lib.PolicySpec, "stop_sequences", ("",), "policy.stop_sequences"),
    (spec_lib.SimulatorSpec, "http_deadline_s", 0.0, "simulator.http_deadline_s"),
    (spec_lib.SimulatorSpec, "temperature", float("nan"), "simulator.temperature"),
    (spec_lib.SimulatorSpec, "append_buckets", (), "simulator.append_buckets"),
    (spec_lib.RLSpec, "epochs", 0, "rl.epochs"),
    (spec_lib.RLSpec, "micro_batch_size", 0, "rl.micro_batch_size"),
    (spec_lib.RLSpec, "mini_batch_rows", -2, "rl.mini_batch_rows"),
    (spec_lib.RLSpec, "loss_agg", "token_mean", "rl.loss_agg"),
    (spec_lib.RLSpec, "kl_kind", "k4", "rl.kl_kind"),
    (spec_lib.RLSpec, "dual_clip", 0.5, "rl.dual_clip"),
    (spec_lib.RLSpec, "clip_low", 1.5, "rl.clip_low"),
    (spec_lib.RLSpec, "gamma", 1.5, "rl.gamma"),
    (spec_lib.RLSpec, "loss_norm_len", -1, "rl.loss_norm_len"),
    (spec_lib.RLSpec, "turn_credit", "per_turn", "rl.turn_credit"),
    (spec_lib.RLSpec, "dynamic_sampling_max_rounds", -1, "rl.dynamic_sampling_max_rounds"),
    (spec_lib.RLSpec, "dynamic_sampling", 1, "rl.dynamic_sampling"),
    (spec_lib.RLSpec, "policy_loss", "dapo", "rl.policy_loss"),
    (spec_lib.RLSpec, "is_correction", "seq", "rl.is_correction"),
    (spec_lib.RLSpec, "is_cap", 1.0, "rl.is_cap"),
    (spec_lib.OptimSpec, "actor_lr", 0.0, "optim.actor_lr"),
    (spec_lib.OptimSpec, "warmup_unit", "epochs", "optim.warmup_unit"),
    (spec_lib.OptimSpec, "b2", 1.0, "optim.b2"),
    (spec_lib.CheckpointSpec, "keep", 0, "checkpoint.keep"),
    (spec_lib.CheckpointSpec, "preempt_deadline_s", 0.0, "checkpoint.preempt_deadline_s"),
    (spec_lib.EvalSpec, "max_turns", 0, "eval.max_turns"),
    (spec_lib.EvalSpec, "policy_prompt", "therapist", "eval.policy_prompt"),
    (spec_lib.EvalSpec, "start_emotion", -1, "eval.start_emotion"),
    (spec_lib.EvalSpec, "batch_size", 0, "eval.batch_size"),
    (spec_lib.EvalSpec, "top_k", -1, "eval.top_k"),
]


@pytest.mark.parametrize("cls,field,value,key", _BAD)
def test_each_section_names_its_key(cls, field, value, key):
  cls()  # the defaults are valid
  with pytest.raises(ConfigError, match=r"config\." + key.replace(".", r"\.")):
    cls(**{field: value})


def test_the_http_simulator_needs_its_server_and_no_top_k():
  with pytest.raises(ConfigError, match=r"config\.simulator\.http_base_url"):
    spec_lib.SimulatorSpec(backend="http")
  with pytest.raises(ConfigError, match=r"config\.simulator\.top_k=20"):
    spec_lib.SimulatorSpec(backend="http", http_base_url="http://x/v1", http_model="m", top_k=20)


def test_settings_across_sections_are_checked_by_the_run():
  base = RunSpec.from_config(_config("base"))
  with pytest.raises(ConfigError, match=r"config\.rl\.format_penalty"):
    dataclasses.replace(base, rl=dataclasses.replace(base.rl, format_penalty=True))
  with pytest.raises(ConfigError, match=r"config\.data\.num_holdout=0"):
    dataclasses.replace(base, data=dataclasses.replace(base.data, num_holdout=0))
  with pytest.raises(ConfigError, match=r"config\.eval\.num_profiles=21"):
    dataclasses.replace(base, eval=dataclasses.replace(base.eval, num_profiles=21))
  for steps in (-1, 0):  # zero would train nothing
    with pytest.raises(ConfigError, match=rf"^config\.total_steps={steps}: must be >= 1"):
      dataclasses.replace(base, total_steps=steps)
  ppo_think = RunSpec.from_config(_config("ppo_think"))
  with pytest.raises(ConfigError, match=r"config\.rl\.gamma=0\.99"):
    dataclasses.replace(ppo_think, rl=dataclasses.replace(ppo_think.rl, gamma=0.99))


def test_dynamic_sampling_and_turn_credit_are_grpo_only():
  ppo = RunSpec.from_config(_config("ppo_think"))
  with pytest.raises(ConfigError, match=r"config\.rl\.turn_credit='turn_index' needs algo=grpo"):
    dataclasses.replace(ppo, rl=dataclasses.replace(ppo.rl, turn_credit="turn_index"))
  with pytest.raises(ConfigError, match=r"config\.rl\.dynamic_sampling=True needs algo=grpo"):
    dataclasses.replace(ppo, rl=dataclasses.replace(ppo.rl, dynamic_sampling=True))
  grpo = RunSpec.from_config(_config("grpo_think"))
  grpo = dataclasses.replace(grpo, rl=dataclasses.replace(grpo.rl, turn_credit="all_turns"))
  assert grpo.algorithm == GRPO(mean_only=False, turn_credit="all_turns")


def test_the_algorithm_is_a_value():
  grpo, ppo = RunSpec.from_config(_config("grpo_think")), RunSpec.from_config(_config("ppo_think"))
  assert grpo.algorithm == GRPO(mean_only=False) and not grpo.algorithm.has_critic
  assert ppo.algorithm == PPO(gamma=1.0, lam=1.0, whiten=True) and ppo.algorithm.has_critic
  assert grpo.algorithm.warning_groups([3, 3, 5]) == [3, 3, 5]
  assert ppo.algorithm.warning_groups([3, 3, 5]) == [0, 0, 0]


def test_derived_settings():
  spec = RunSpec.from_config(_config("grpo_think"))
  assert spec.rl.rows_per_mini_batch == spec.rl.profiles_per_step * spec.rl.group_size
  assert spec.loss_config().norm_len == spec.policy.max_context
  reference = RunSpec.from_config(_config("grpo_think", "reference"))
  assert reference.optim.optim_config().warmup_steps == 0  # counted in RL steps by the trainer
  assert reference.optim.warmup(critic=True) == 50
  assert spec.optim.optim_config(critic=True).learning_rate == spec.optim.critic_lr


def test_policy_loss_and_rollout_correction_settings():
  rl = spec_lib.RLSpec
  assert rl().correction == ("none", 2.0)
  new = dataclasses.replace(RunSpec.from_config(_config("base")),
                            rl=rl(is_correction="token_tis", is_cap=1.5))
  assert (new.loss_config().is_correction, new.loss_config().is_cap) == ("token_tis", 1.5)
  # rl.tis_cap (the older spelling of token_tis) is gone: a config that sets it is told the new keys;
  # a saved config of an earlier version, where it was off (0), still loads.
  with pytest.raises(ConfigError, match=r"^config\.rl\.tis_cap was removed: use config\.rl\."
                                        r"is_correction='token_tis' with config\.rl\.is_cap=C$"):
    RunSpec.from_config({"rl": {"tis_cap": 1.5}})
  assert RunSpec.from_config({"rl": {"tis_cap": 0.0}}).rl.correction == ("none", 2.0)
  with pytest.raises(ConfigError, match=r"config\.rl\.dual_clip=3\.0: must be 0 with rl\.policy_loss='cispo'"):
    rl(policy_loss="cispo", dual_clip=3.0)
  rl(policy_loss="gspo", dual_clip=3.0)  # the clipped surrogate on the sequence ratio: allowed
  assert dataclasses.replace(new, rl=rl(policy_loss="cispo")).loss_config().policy_loss == "cispo"


def test_the_run_entry_points_take_the_spec_not_the_config_dict(tmp_path):
  """Training and the Sentient evaluation read typed settings only; a ConfigDict passed by an older
  notebook is refused at once, saying how to build the spec, before anything is written."""
  from rlver_jax.evaluation import sentient
  from rlver_jax.train import loop
  with pytest.raises(TypeError, match=r"takes a RunSpec \(RunSpec\.from_config\(config\)\), not ConfigDict"):
    loop.run(_config("base", "runlocal"), str(tmp_path / "run"))
  with pytest.raises(TypeError, match=r"takes an EvaluationSpec .* not ConfigDict"):
    sentient.run(_config("eval_sentient", "runlocal"), str(tmp_path / "eval"))
  assert not list(tmp_path.iterdir())
