"""The run's config in its workdir: written at start, checked on resume.

Settings that change results must match the saved ones; run-length keys (how long, how often to
save, log or evaluate) may change, so a finished run can be continued with a larger total_steps.
"""
from __future__ import annotations

import json
import re
import sys

import jax
import ml_collections
from etils import epath

RUN_LENGTH_KEYS = ("total_steps", "checkpoint.", "eval.every_steps", "log.")


class ConfigConflictError(ValueError):
  pass


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def check_workdir_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Fails if WORKDIR/config.json exists and conflicts with `config` (writes nothing)."""
  path = epath.Path(workdir) / "config.json"
  new = _flat(json.loads(config.to_json()))
  if path.exists():
    old = _flat(json.loads(path.read_text()))
    changed = sorted(k for k in set(old) | set(new)
                     if old.get(k) != new.get(k) and not k.startswith(RUN_LENGTH_KEYS))
    if changed:
      k = changed[0]
      raise ConfigConflictError(
          f"{path}: config.{k} was {old.get(k)!r} in this workdir, now {new.get(k)!r} "
          f"({len(changed)} conflicting key(s): {', '.join(changed[:5])}); use a new --workdir")


def write_workdir_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes WORKDIR/config.json; call once every input has been checked and loaded, so a start that
  fails on bad input leaves no config behind to conflict with the corrected command."""
  path = epath.Path(workdir) / "config.json"
  if jax.process_count() > 1:
    # Every host read the old file in check_workdir_config before process 0 replaces it (no host
    # reads a half-written file).
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("rlver_jax:write_workdir_config")
  if jax.process_index() == 0:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_json(indent=2, sort_keys=True) + "\n")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a --config.KEY override that names no key as a one-line error.

  ml_collections raises AttributeError from inside the parser for such a key, which absl would
  print as a traceback (its own flag errors are already one line).
  """
  from absl import app
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError) as e:
    name = str(e).strip("\"'")
    bad = [a.split("=")[0] for a in argv[1:]
           if a.startswith("--config.") and re.search(rf"\.{re.escape(name)}(\.|=|$)", a)]
    flag = bad[0] if bad else "a --config.KEY override"
    sys.exit(f"error: {flag}: no such config key ({name!r}); see the config file for its keys")
