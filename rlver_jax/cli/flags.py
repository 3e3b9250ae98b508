"""absl flag parsing for the entry points: config errors as one line, library logs quiet."""
from __future__ import annotations

import re
import sys

from absl import flags

from rlver_jax.cli.console import quiet_library_logs, skip_absent_tpu


def _missing_key(e: BaseException) -> tuple[str, str]:
  """(key, ml_collections' suggestion) from its AttributeError(KeyError("'key'\\nDid you mean ...")):
  the text of the innermost exception, not the repr str() gives a KeyError."""
  while e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]
  text = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
  name, _, hint = text.partition("\n")
  return name.strip("\"'"), " ".join(hint.split())


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with two config errors as one line instead of a traceback (a
  --config.KEY override that names no key, and a config file whose get_config raised, e.g. a
  mistyped `:runloca` argument; the config's own message lists the known arguments), and library
  INFO logs hidden unless --verbosity is given (`console.quiet_library_logs`).

  ml_collections raises AttributeError from inside the parser for such a key, and wraps an error of
  get_config with its traceback into the flag error that absl prints.

  First, on a machine without a TPU, jax is kept from starting libtpu (`console.skip_absent_tpu`).
  """
  skip_absent_tpu()  # before any flag's value (or the config file) can start jax's backends
  try:
    rest = flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    name, hint = _missing_key(e)
    bad = [a.split("=")[0] for a in argv[1:]
           if a.startswith("--config.") and re.search(rf"\.{re.escape(name)}(\.|=|$)", a)]
    flag = bad[0] if bad else "a --config.KEY override"
    todo = f"{hint[:1].lower()}{hint[1:]}" if hint else "see the config file for its keys"
    sys.exit(f"error: {flag}: no such config key '{name}'; {todo}")
  except flags.Error as e:
    text = str(e)
    wrapped = re.match(r"flag (.*?): Error whilst parsing config file", text)
    if wrapped:
      last = [l.strip() for l in text.splitlines() if l.strip()][-1]  # the exception's own line
      sys.exit(f"error: {wrapped.group(1)}: {last}")
    # absl's own wording for every other flag error (already one line)
    sys.stderr.write(f"FATAL Flags parsing error: {text}\nPass --helpshort or --helpfull to see help "
                     "on flags.\n")
    sys.exit(1)
  quiet_library_logs()  # library INFO lines only with an explicit --verbosity
  return rest
