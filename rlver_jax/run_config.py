"""The run's config in its workdir: written at start, checked on resume.

Settings that change results must match the saved ones; run-length keys (how long, how often to
save, log or evaluate) may change, so a finished run can be continued with a larger total_steps.
"""
from __future__ import annotations

import json

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
