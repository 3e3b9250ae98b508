"""Files and directories written so that neither a kill mid-write nor a concurrent run can clobber them."""
from __future__ import annotations

import os

from etils import epath


def replace_text(path: epath.Path, text: str) -> None:
  """Writes `text` to `path` so that a kill mid-write leaves the old file: a renamed temp file
  locally; a gs:// object is replaced in one upload anyway."""
  if str(path).startswith("gs://"):
    path.write_text(text)
    return
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


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
  """Fails with one line naming --workdir unless `workdir` is (or can be made) a writable directory:
  checked before any model loads (minutes at 7B/72B), not when the first file is written."""
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


def _reason(e: OSError) -> str:
  return e.strerror or str(e) or type(e).__name__
