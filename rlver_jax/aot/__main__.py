"""`python -m rlver_jax.aot`: the ahead-of-time compile and memory report (rlver_jax.aot.cli)."""
from absl import app

from rlver_jax.aot import cli
from rlver_jax.cli.flags import parse_flags

if __name__ == "__main__":
  app.run(cli.main, flags_parser=parse_flags)
