"""Hugging Face Hub model ids as checkpoint settings: `ORG/NAME`, or `ORG/NAME@REVISION` pinned.

A checkpoint setting of that form that is not an existing local path is a Hub id. `resolve` turns it
into the snapshot directory huggingface_hub keeps in its cache (HF_HUB_CACHE, default HF_HOME/hub):
`models--ORG--NAME/snapshots/COMMIT/`, named by the commit that provenance records. Only what loading
reads is downloaded: the top-level safetensors weights, JSON files (config, shard index, tokenizer
settings) and tokenizer files. With HF_HUB_OFFLINE=1 (or no network) the cache alone answers.

With several processes (one per host) every process calls `resolve` at the same point. Process 0
resolves first, downloading what its cache lacks, and hands its commit to the others; they look that
commit up in their own cache and download it only if it is missing there. Hosts that share a disk
thus download once, hosts with their own disks once each, and every host loads the same commit even
if a branch moves meanwhile (two processes on one disk are kept apart by huggingface_hub's file locks).
"""
from __future__ import annotations

import os
import re

import jax
import numpy as np

from rlver_jax.parallel.process_zero import answers_from_process_zero

# A Hub repo id (`namespace/name`, each [\w.-]) with an optional `@revision` (branch, tag, commit).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@\S+)?")
# What the loaders read, at the top level only (they never look into subfolders).
ALLOW_PATTERNS = ("*.safetensors", "*.json", "tokenizer*", "vocab*", "merges.txt", "*.model",
                  "*.jinja")
IGNORE_PATTERNS = ("*/*",)


class HubError(ValueError):
  """A Hub checkpoint that cannot be had; the message names the setting, the id and what to do."""


def is_hub_id(setting: str) -> bool:
  """Whether a checkpoint setting names a Hub model (a local path of the same name wins)."""
  return bool(_HUB_ID.fullmatch(str(setting))) and not os.path.exists(setting)


def split(hub_id: str) -> tuple[str, str]:
  """(repo id, revision); the revision defaults to the Hub's `main` branch."""
  repo, _, revision = hub_id.partition("@")
  return repo, revision or "main"


def offline() -> bool:
  """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now; huggingface_hub reads it once, at import."""
  from huggingface_hub import constants
  return constants.HF_HUB_OFFLINE or any(
      os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
      for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cache_dir() -> str:
  from huggingface_hub import constants
  return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def commit_of(snapshot_dir: str) -> str:
  return os.path.basename(os.path.normpath(snapshot_dir))


# Per process, so a run's provenance and its loaders see one commit (and ask the Hub once).
_resolved: dict[tuple, str] = {}


def resolve(hub_id: str, setting: str) -> str:
  """The local snapshot directory of `hub_id`; `setting` ("config.policy.checkpoint",
  "--checkpoint") names where the id came from in errors. With several processes, all must call
  this at the same point (it takes part in collectives)."""
  repo, revision = split(hub_id)
  key = (repo, revision, cache_dir(), offline())
  if key not in _resolved:
    _resolved[key] = _resolve(repo, revision, f"{setting}={hub_id}")
  return _resolved[key]


def _resolve(repo: str, revision: str, where: str) -> str:
  if jax.process_count() == 1:
    return _snapshot(repo, revision, where)
  commit, = answers_from_process_zero(lambda: [commit_of(_snapshot(repo, revision, where))],
                                      HubError)
  path, error = None, None
  try:
    path = _snapshot(repo, commit, where, cache_first=True)
  except Exception as e:  # a vote below: no host may raise alone while the others go on to load
    error = e
  from jax.experimental import multihost_utils
  votes = np.asarray(multihost_utils.process_allgather(np.int32(path is not None))).reshape(-1)
  failed = [int(i) for i in np.flatnonzero(votes == 0)]
  if error is not None:
    raise error
  if failed:
    raise HubError(f"{where}: processes {failed} of {jax.process_count()} could not get commit "
                   f"{commit} (their own errors say why)")
  return path


def _snapshot(repo: str, revision: str, where: str, cache_first: bool = False) -> str:
  """The snapshot of `revision`: from the Hub (falling back to the cache when it cannot be reached),
  or with `cache_first` (a commit, which never changes) from the cache unless it is missing there."""
  from huggingface_hub import snapshot_download
  from huggingface_hub import errors as hub_errors
  kwargs = dict(revision=revision, cache_dir=cache_dir(), allow_patterns=list(ALLOW_PATTERNS),
                ignore_patterns=list(IGNORE_PATTERNS))
  try:
    if cache_first or offline():
      try:
        path = snapshot_download(repo, local_files_only=True, **kwargs)
      except hub_errors.LocalEntryNotFoundError:
        if offline():
          raise
        path = snapshot_download(repo, **kwargs)
    else:
      path = snapshot_download(repo, **kwargs)
  except hub_errors.LocalEntryNotFoundError as e:
    incomplete = isinstance(e, hub_errors.IncompleteSnapshotError)
    held = "only part of it is" if incomplete else "it is not"
    why = ("HF_HUB_OFFLINE=1 forbids downloading it" if offline()
           else "the Hub could not be reached")
    raise HubError(f"{where}: no such local directory, {held} in the Hugging Face cache "
                   f"{cache_dir()}, and {why}: download it where the Hub is reachable (HF_HUB_OFFLINE "
                   "unset) or point HF_HUB_CACHE at a cache that holds it") from e
  except hub_errors.RevisionNotFoundError as e:
    raise HubError(f"{where}: the Hub has no revision {revision!r} of {repo}") from e
  except hub_errors.GatedRepoError as e:
    raise HubError(f"{where}: {repo} is gated on the Hub: accept its terms on huggingface.co and "
                   "set HF_TOKEN") from e
  except hub_errors.RepositoryNotFoundError as e:
    raise HubError(f"{where}: no such local directory, and no model {repo} on the Hub (a private "
                   "one needs HF_TOKEN)") from e
  except hub_errors.HfHubHTTPError as e:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise HubError(f"{where}: the Hub refused the download ({first})") from e
  if not any(name.endswith(".safetensors") for name in os.listdir(path)):
    raise HubError(f"{where}: commit {commit_of(path)} of {repo} has no safetensors weights (only "
                   "safetensors are loaded): pick a revision that has them")
  return path
