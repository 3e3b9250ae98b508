"""The run's persistent compilation cache (config `compile_cache_dir`): XLA programs compiled once
are stored there, so a resumed, preempted or repeated run reads them back instead of compiling every
decode, append and update program again.

The default, `{workdir}/compile_cache`, lives beside the checkpoints: a run resumed on a new VM (a
preempted TPU slice is recreated) finds it with its gs:// workdir, and deleting a run deletes its
cache. JAX's own thresholds apply (`jax_persistent_cache_min_compile_time_secs`, 1 s by default, and
`jax_persistent_cache_min_entry_size_bytes`): a program compiled faster than that is not stored, as
reading it back from a bucket costs about as much. The cache is trusted code, like the checkpoints
beside it: point it only at folders no one else writes to.
"""
from __future__ import annotations

import os

from rlver_jax.spec import WORKDIR_PLACEHOLDER as WORKDIR

# The default folder's name under the workdir; run/workdir.py counts it as a run's own file.
FOLDER = "compile_cache"


def resolve(setting: str, workdir: str) -> str:
  """The cache folder for a run in `workdir` ('' = none)."""
  if not setting:
    return ""
  return os.path.expanduser(setting.replace(WORKDIR, workdir.rstrip("/")))


def enable(folder: str) -> None:
  """Points JAX's persistent compilation cache at `folder` before the run's first compile; ''
  leaves JAX's own setting (off unless JAX_COMPILATION_CACHE_DIR is set)."""
  if not folder:
    return
  from jax.experimental.compilation_cache import compilation_cache
  compilation_cache.set_cache_dir(folder)
  # JAX fixes its cache at the first compile: one made earlier (an import's) must not keep it off.
  compilation_cache.reset_cache()
