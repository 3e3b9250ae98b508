"""The typed run spec: every setting's one declaration and default, and the one reader of a config.

Each section dataclass declares its keys with their defaults and what each means; `default_tree`
turns a spec class into the plain tree a config file (configs/base.py, configs/eval_sentient.py)
starts from, so a config file assigns only what differs (the paper's models, per algorithm and mode).

`RunSpec.from_config` (training, configs/base.py) and `EvaluationSpec.from_config` (the Sentient
evaluation, configs/eval_sentient.py) turn the ConfigDict into a tree of frozen dataclasses, one per
config section, with one field per config key. Each section checks its own fields in `__post_init__`
and the top-level spec checks what spans sections, so building the spec *is* the check that every
setting used late in a run (at the first update, the first held-out evaluation) can work: it runs
before any model loads or any file is written. Every message names the key: `config.rl.clip_low=1.5:
must be in (0, 1)`.

Everything below the CLIs takes these dataclasses; the typed settings of the lower layers
(MeshConfig, LossConfig, OptimConfig, RolloutConfig) are leaves of the tree or built from it here.

`sections`: the section dataclasses and their checks (`rl_section`: config.rl's); `run`: RunSpec, EvaluationSpec and the
conversion; `layouts`: each decoding model's mesh (simulator.mesh, rollout.policy_mesh) from its
setting and the model's head counts. May import the lower folders' constants, checks and typed
settings (env, rl, sampling, models, parallel); never build, train, evaluation or run.
"""
from rlver_jax.spec.run import WORKDIR_PLACEHOLDER, EvaluationSpec, RunSpec, default_tree
from rlver_jax.spec.sections import (CheckpointSpec, ConfigError, CriticSpec, DataSpec, EvalSpec,
                                     LogSpec, OptimSpec, PolicySpec, RolloutSpec,
                                     SimulatorSpec, require)
from rlver_jax.spec.rl_section import RLSpec

__all__ = ["CheckpointSpec", "ConfigError", "CriticSpec", "DataSpec", "EvalSpec", "EvaluationSpec",
           "LogSpec", "OptimSpec", "PolicySpec", "RLSpec", "RolloutSpec", "RunSpec",
           "SimulatorSpec", "WORKDIR_PLACEHOLDER", "default_tree", "require"]
