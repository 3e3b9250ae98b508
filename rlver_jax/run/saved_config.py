"""The run's config in its workdir: written at start, checked on resume.

Settings that change results must match the saved ones; run-length keys (how long, how often to
save, log or evaluate) may change, so a finished run can be continued with a larger total_steps, and
so may where compiled programs are cached.
"""
from __future__ import annotations

import json

import jax
import numpy as np
from etils import epath

from rlver_jax.run.workdir import replace_text

RUN_LENGTH_KEYS = ("total_steps", "checkpoint.", "eval.every_steps", "log.", "compile_cache_dir")


class ConfigConflictError(ValueError):
  pass


def config_json(config: dict, indent: int | None = None) -> str:
  """The config (plain data, e.g. `RunSpec.source`) as the JSON of WORKDIR/config.json."""
  return json.dumps(config, indent=indent, sort_keys=True)


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _read_config_json(path: epath.Path) -> dict:
  try:
    old = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigConflictError(f"{path}: not valid JSON ({e}); it records this workdir's config: fix "
                              "or remove it, or use a new --workdir") from None
  if not isinstance(old, dict):
    raise ConfigConflictError(f"{path}: holds a JSON {type(old).__name__}, not a config object; fix "
                              "or remove it, or use a new --workdir")
  return old


def check_workdir_config(config: dict, workdir: str) -> None:
  """Fails if WORKDIR/config.json exists and conflicts with `config` (the run's config as plain data;
  writes nothing)."""
  path = epath.Path(workdir) / "config.json"
  new = _flat(json.loads(config_json(config)))
  if path.exists():
    old = _flat(_read_config_json(path))
    # `kind` is new in config.json: a workdir written before it records none.
    changed = sorted(k for k in set(old) | set(new)
                     if old.get(k) != new.get(k) and not k.startswith(RUN_LENGTH_KEYS)
                     and not (k == "kind" and k not in old))
    if changed:
      k = changed[0]
      raise ConfigConflictError(
          f"{path}: config.{k} was {old.get(k)!r} in this workdir, now {new.get(k)!r} "
          f"({len(changed)} conflicting key(s): {', '.join(changed[:5])}); use a new --workdir")


def processes_without(votes: list[bool]) -> list[list[int]]:
  """Every process votes on the same questions; for each question, the processes that voted no.
  A collective: all processes call it at the same point, none raising on its own before."""
  from jax.experimental import multihost_utils
  everyone = np.asarray(multihost_utils.process_allgather(np.asarray(votes, np.int32)))
  everyone = everyone.reshape(jax.process_count(), len(votes))
  return [[int(i) for i in np.flatnonzero(everyone[:, j] == 0)] for j in range(len(votes))]


def check_shared_workdir(workdir: str) -> None:
  """With several processes, fails on every host unless all of them see the same `workdir`.

  A local path on a pod is usually each host's own disk: orbax would scatter one checkpoint over
  them (unrestorable) and only host 0 would have the config and metrics. Process 0 writes a marker
  with a token it broadcasts; every host must read that token back. gs:// is shared by design.
  """
  if jax.process_count() == 1 or str(workdir).startswith("gs://"):
    return
  import secrets
  from jax.experimental import multihost_utils
  from rlver_jax.parallel.sharding import broadcast_bytes
  token = broadcast_bytes(secrets.token_hex(8).encode() if jax.process_index() == 0 else None)
  marker = epath.Path(workdir) / f".shared-check-{token.decode()}"
  # File errors become a "not seen" vote rather than an exception on one host, which would leave
  # the others waiting in the collectives below forever.
  write_error = None
  if jax.process_index() == 0:
    try:
      marker.parent.mkdir(parents=True, exist_ok=True)
      marker.write_bytes(token)
    except OSError as e:
      write_error = e
  multihost_utils.sync_global_devices("rlver_jax:shared_workdir_written")
  try:
    seen = marker.exists() and marker.read_bytes() == token
  except OSError:
    seen = False
  blind, = processes_without([seen])
  multihost_utils.sync_global_devices("rlver_jax:shared_workdir_read")
  if jax.process_index() == 0 and write_error is None:
    marker.unlink(missing_ok=True)
  if blind:
    if 0 in blind:  # the others only know that process 0 failed; process 0 also knows why
      why = "process 0 cannot use it" + (f": {write_error}" if write_error is not None else "")
    else:
      why = f"processes {blind} do not see process 0's files"
    raise ValueError(f"--workdir={workdir} is not shared by all {jax.process_count()} processes "
                     f"({why}): use gs:// or a shared mount")


def check_inputs_on_every_host(paths: dict[str, str]) -> None:
  """With several processes, fails on every host unless each one sees every input (config key ->
  path). A host missing one would fail while loading it, and the others would wait for it in the
  loading's collectives until the coordination service aborted them all minutes later."""
  if jax.process_count() == 1 or not paths:  # no paths: the embedded model and demo profiles
    return

  def seen(path: str) -> bool:
    try:
      return epath.Path(path).exists()
    except OSError:  # a vote like any other: no host may raise alone here
      return False
  keys = sorted(paths)
  for key, blind in zip(keys, processes_without([seen(paths[k]) for k in keys])):
    if blind:
      raise ValueError(f"config.{key}: {paths[key]} is not seen by processes {blind} of "
                       f"{jax.process_count()}: every host must see every input (gs:// or a shared "
                       f"mount)")


def write_workdir_config(config: dict, workdir: str) -> None:
  """Writes WORKDIR/config.json; call once every input has been checked and loaded, so a start that
  fails on bad input leaves no config behind to conflict with the corrected command."""
  path = epath.Path(workdir) / "config.json"
  if jax.process_count() > 1:
    # Every host read the old file in check_workdir_config before process 0 replaces it (no host
    # reads a half-written file).
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("rlver_jax:write_workdir_config")
  from rlver_jax.parallel.process_zero import on_process_zero

  def write() -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, config_json(config, indent=2) + "\n")
  on_process_zero(f"writing {path}", write)
