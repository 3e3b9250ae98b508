r"""Evaluate a policy checkpoint Sentient-style: simulated users, emotion starts at 40, score = mean
final emotion.

  python -m rlver_jax.evaluate --config=configs/eval_sentient.py[:runlocal] --workdir=DIR \
    [--config.policy.checkpoint=HF_DIR] [--config.data.profiles=PATH] [--config.eval.num_profiles=N]

Writes DIR/eval_summary.json (score, success / failure rates, breakdowns per task and personality,
turns, parse failures, the config), DIR/transcripts.jsonl (one dialogue a line),
DIR/emotion_trajectories.png and DIR/config.json. The policy checkpoint is an HF directory; export
a training run first with `python -m rlver_jax.export`.
"""
from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from rlver_jax.parallel import distributed
from rlver_jax.cli.errors import exit_on
from rlver_jax.cli.flags import parse_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/eval_sentient.py.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (local or gs://).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  distributed.initialize()
  from rlver_jax.evaluation import sentient  # after distributed init: imports may touch devices
  from rlver_jax.spec import EvaluationSpec
  from rlver_jax.env.backends import SimulatorBackendError
  from rlver_jax.parallel.process_zero import ProcessZeroError
  from rlver_jax.run import compile_cache
  from rlver_jax.run.workdir import refuse_training_workdir
  try:
    spec = EvaluationSpec.from_config(_CONFIG.value)
    refuse_training_workdir(spec.policy.checkpoint, "--config.policy.checkpoint")
    compile_cache.enable(compile_cache.resolve(spec.compile_cache_dir, _WORKDIR.value))
    summary, paths = sentient.run(spec, _WORKDIR.value)
  # Bad input, an unwritable workdir, or a simulator that cannot answer within its retry bound (on
  # any host): one line, non-zero exit.
  except (ValueError, OSError, SimulatorBackendError, ProcessZeroError) as e:
    exit_on(e)
  print(f"\nscore {summary['score']:.1f}  success {summary['success_rate']:.0%}  "
        f"failure {summary['failure_rate']:.0%}  ({summary['num_dialogues']} dialogues)")
  print(f"outputs under {_WORKDIR.value}:")
  for k, v in paths.items():
    print(f"  {k:12s} {v}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
