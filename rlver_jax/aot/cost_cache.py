"""Compiled programs' costs kept on disk, so a second estimate compiles only what changed.

A libtpu compile of one step's programs takes 19-49 minutes on a 2-core machine; lowering them takes
seconds. The key is a hash of what decides the compiled program: the lowered module's text (no
source locations, so an edit elsewhere in a file does not miss), the compiler options, the devices
it is compiled for (kind, ids, coordinates, in mesh order), the jax and libtpu versions, and
`FORMAT` (what a stored cost holds). One JSON file per key under the cache's directory:
`--cost_cache=DIR`, default ~/.cache/rlver_jax/aot_costs; '' turns it off.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile
from typing import Any

import jax

FORMAT = 1
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "rlver_jax", "aot_costs")


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "-"


def fingerprint(module_text: str, compiler_options: dict[str, str] | None,
                devices: Any) -> str:
  """The key of one program: sha256 over everything its compiled cost depends on."""
  where = [(d.platform, d.device_kind, d.id, tuple(getattr(d, "coords", ()) or ()))
           for d in devices]
  head = json.dumps({"format": FORMAT, "options": sorted((compiler_options or {}).items()),
                     "devices": where, "jax": jax.__version__, "libtpu": _version("libtpu")},
                    default=str)
  h = hashlib.sha256(head.encode())
  h.update(module_text.encode())
  return h.hexdigest()


class CostCache:
  """{key: dict of floats} in `directory` (created on the first write); hits and misses counted."""

  def __init__(self, directory: str):
    self.directory = pathlib.Path(directory)
    self.hits = self.misses = 0

  def get(self, key: str) -> dict[str, float] | None:
    try:
      stored = json.loads((self.directory / f"{key}.json").read_text())
    except (OSError, ValueError):  # absent, or a torn file: compile again
      self.misses += 1
      return None
    self.hits += 1
    return stored

  def put(self, key: str, value: dict[str, float]) -> None:
    self.directory.mkdir(parents=True, exist_ok=True)
    # Written whole, then renamed: a reader never sees half a file.
    with tempfile.NamedTemporaryFile("w", dir=self.directory, suffix=".tmp", delete=False) as f:
      json.dump(value, f)
    os.replace(f.name, self.directory / f"{key}.json")

  def describe(self) -> str:
    return f"cost cache {self.directory}: {self.hits} hits, {self.misses} compiled"
