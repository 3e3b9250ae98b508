"""Whole-file replacement that a kill mid-write cannot truncate."""
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
