"""Files and directories written so that neither a kill mid-write nor a concurrent run can clobber them."""
from __future__ import annotations

import os

from etils import epath

from rlver_jax.run import compile_cache
from rlver_jax.run.workdir_lock import LOCK_FILE


def replace_text(path: epath.Path, text: str) -> None:
  """Writes `text` to `path` so that a kill mid-write leaves the old file: a renamed temp file
  locally; a gs:// object is replaced in one upload anyway."""
  if str(path).startswith("gs://"):
    path.write_text(text)
    return
  tmp = path.with_name(path.name + ".tmp")
  try:
    tmp.write_text(text)
    os.replace(tmp, path)
  except OSError:
    tmp.unlink(missing_ok=True)  # a full disk leaves no half-written temp file behind
    raise


def new_run_dir(parent: str, stem: str) -> str:
  """Creates and returns PARENT/STEM, or STEM-2, STEM-3, ... if taken: two runs started in the same
  second must not share (and resume into) one workdir. mkdir is atomic, so this holds across processes."""
  os.makedirs(parent, exist_ok=True)
  for i in range(1, 1000):
    path = os.path.join(parent, stem if i == 1 else f"{stem}-{i}")
    try:
      os.mkdir(path)
      return path
    except FileExistsError:
      continue
  raise FileExistsError(f"{parent}/{stem}: 999 run directories of that name exist; pass --workdir")


def check_workdir(workdir: str) -> None:
  """Fails with one line naming --workdir unless `workdir` is (or can be made) a writable directory
  that is empty or a run's own: checked before any model loads (minutes at 7B/72B), not when the
  first file is written."""
  path = epath.Path(workdir)
  try:
    if path.exists() and not path.is_dir():
      raise ValueError(f"--workdir={workdir}: exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--workdir={workdir}: cannot be created ({_reason(e)})") from None
  probe = path / f".write-check-{os.getpid()}-{os.uname().nodename}"
  try:
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    raise ValueError(f"--workdir={workdir}: is not writable ({_reason(e)})") from None
  check_is_a_run(workdir)


# What a run writes first (the lock before anything else; checkpoints/ and metrics.jsonl also by
# runs older than the lock), and the temp files of its replace_text writes cut short: any of them
# marks a run's own workdir, which a resume reuses.
RUN_MARKERS = (LOCK_FILE, "provenance.json", "metrics.jsonl", "checkpoints", "provenance.json.tmp",
               "metrics.jsonl.tmp", "config.json.tmp", compile_cache.FOLDER)
# Left by this check itself, check_shared_workdir (killed mid-check, or another host's in flight),
# or a fresh filesystem: not content.
_NOT_CONTENT = (".write-check-", ".shared-check-", "lost+found")


def check_is_a_run(workdir: str) -> None:
  """Fails with one line naming --workdir if it holds files but none a run writes: a run would
  write into (and rotate checkpoints in) someone else's folder, e.g. a model's."""
  try:
    names = sorted(p.name for p in epath.Path(workdir).iterdir())
  except FileNotFoundError:  # a gs:// prefix with no objects: GCS has no empty folders
    names = []
  except OSError as e:
    raise ValueError(f"--workdir={workdir}: cannot be listed ({_reason(e)})") from None
  if any(n in RUN_MARKERS for n in names):
    return
  found = [n for n in names if not n.startswith(_NOT_CONTENT)]
  if found:
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    raise ValueError(f"--workdir={workdir}: holds files but is not a run's workdir ({shown}); "
                     "use a new or empty directory")


def refuse_training_workdir(path: str, setting: str) -> None:
  """A model input that is a training workdir (its config.json is the run's, not a model's) is
  refused with the way to get a model out of it, before anything reads it as one."""
  from rlver_jax.models.io import storage
  if storage.exists(storage.join(path, "checkpoints")):
    raise ValueError(f"{setting}={path}: is a training workdir, not a Hugging Face checkpoint; export "
                     f"its policy first (python -m rlver_jax.export --workdir={path} --out=HF_DIR) "
                     f"and pass {setting}=HF_DIR")


def _reason(e: OSError) -> str:
  return e.strerror or str(e) or type(e).__name__


def remove_if_unused(path: str, lock_file: str) -> None:
  """A default workdir made for a run that failed before writing anything is not left behind: its
  empty compile-cache folder (JAX makes it at a first compile) and our lock file go, then the
  folder if nothing else is in it."""
  from rlver_jax.run.compile_cache import FOLDER
  try:
    cache = os.path.join(path, FOLDER)
    if os.path.isdir(cache) and not os.listdir(cache):
      os.rmdir(cache)
    if os.listdir(path) == [lock_file]:  # ours: the run holds it until it exits
      os.remove(os.path.join(path, lock_file))
    os.rmdir(path)
  except OSError:  # not empty (or already gone): keep what the run wrote
    pass
