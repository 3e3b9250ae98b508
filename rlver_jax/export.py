r"""Write a trained policy as a Hugging Face safetensors checkpoint.

  python -m rlver_jax.export --workdir=RUN_DIR [--step=N] --out=HF_DIR [--overwrite] [--dtype=bfloat16]

Restores the policy params of step N (default: the latest) from RUN_DIR/checkpoints, using the run's
RUN_DIR/config.json to rebuild the policy as the trainer built it, and writes them with the base
checkpoint's config and tokenizer files. The dtype defaults to the base checkpoint's (e.g. bf16).
Only the policy is read from the checkpoint: optimizer and critic states stay on disk. Evaluate the
result with `python -m rlver_jax.evaluate --config=configs/eval_sentient.py
--config.policy.checkpoint=HF_DIR --workdir=EVAL_DIR`.
"""
from __future__ import annotations

from absl import app, flags

from rlver_jax.parallel import distributed
from rlver_jax.cli.errors import exit_on
from rlver_jax.cli.flags import parse_flags

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory (local or gs://).")
_OUT = flags.DEFINE_string("out", None, "Output HF checkpoint directory (local or gs://).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Write into a non-empty --out.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                           "Tensor dtype (default: the base checkpoint's).")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  distributed.initialize()
  from rlver_jax.run import trained_policy  # after distributed init, as in main.py
  from rlver_jax.parallel.process_zero import ProcessZeroError
  try:
    step = trained_policy.export(_WORKDIR.value, _OUT.value, step=_STEP.value,
                                 overwrite=_OVERWRITE.value, dtype=_DTYPE.value)
  except (ValueError, OSError, ProcessZeroError) as e:  # bad input or --out: one line, exit 1
    exit_on(e)
  print(f"exported step {step} of {_WORKDIR.value} to {_OUT.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
