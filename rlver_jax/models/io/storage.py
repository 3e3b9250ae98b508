"""Byte-level file access for checkpoints on a local disk or in Google Cloud Storage (`gs://bucket/path`).

Only what the checkpoint reader and writer need: byte-range reads (so a loader never holds more than one
tensor), listing, and uploading a finished local file. `STORAGE_EMULATOR_HOST` points the client at a
GCS emulator (tests); it then uses anonymous credentials and project "test".
"""
from __future__ import annotations

import functools
import os
import posixpath
import shutil

_GS = "gs://"


def is_gcs(path: str) -> bool:
  return str(path).startswith(_GS)


def join(base: str, name: str) -> str:
  return posixpath.join(str(base), name) if is_gcs(base) else os.path.join(base, name)


@functools.lru_cache(maxsize=1)
def _client():
  from google.cloud import storage  # Imported lazily: local-only users need no cloud client.
  if os.environ.get("STORAGE_EMULATOR_HOST"):
    from google.auth.credentials import AnonymousCredentials
    return storage.Client(project="test", credentials=AnonymousCredentials())
  return storage.Client()


def point_clients_at_emulator() -> None:
  """With STORAGE_EMULATOR_HOST set, sends every GCS client of a run to that emulator.

  google-cloud-storage and gcsfs (behind epath) read STORAGE_EMULATOR_HOST themselves; tensorstore
  (orbax's array I/O) reads TENSORSTORE_GCS_HTTP_URL instead, and gcsfs would first probe each
  bucket's layout through a gRPC API that emulators lack. Call before the first gs:// access.
  """
  host = os.environ.get("STORAGE_EMULATOR_HOST")
  if not host:
    return
  url = host if host.startswith(("http://", "https://")) else f"http://{host}"
  os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
  os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _split(path: str) -> tuple[str, str]:
  bucket, _, name = str(path)[len(_GS):].partition("/")
  return bucket, name.rstrip("/")


def _blob(path: str):
  bucket, name = _split(path)
  return _client().bucket(bucket).blob(name)


def _prefix(path: str) -> tuple[str, str]:
  bucket, name = _split(path)
  return bucket, (name + "/") if name else ""


def exists(path: str) -> bool:
  """True for an existing file, or (gs://) an object or a non-empty "directory" prefix."""
  if not is_gcs(path):
    return os.path.exists(path)
  if _split(path)[1] and _blob(path).exists():
    return True
  return bool(list_dir(path))


def list_dir(path: str) -> list[str]:
  """Names directly inside a directory (files only for gs://); [] when it does not exist."""
  if not is_gcs(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else []
  bucket, prefix = _prefix(path)
  blobs = _client().list_blobs(bucket, prefix=prefix, delimiter="/")
  return sorted(b.name[len(prefix):] for b in blobs if b.name != prefix)


def read_range(path: str, start: int, end: int) -> bytes:
  """Bytes [start, end) of a file."""
  if end <= start:
    return b""
  if is_gcs(path):
    return _blob(path).download_as_bytes(start=start, end=end - 1)  # GCS ranges are inclusive.
  with open(path, "rb") as f:
    f.seek(start)
    data = f.read(end - start)
  if len(data) != end - start:
    raise OSError(f"{path}: file is truncated (wanted bytes {start}..{end}, got {len(data)})")
  return data


def read_bytes(path: str) -> bytes:
  if is_gcs(path):
    return _blob(path).download_as_bytes()
  with open(path, "rb") as f:
    return f.read()


def copy_to_local(src: str, dst: str) -> None:
  if is_gcs(src):
    _blob(src).download_to_filename(dst)
  else:
    shutil.copyfile(src, dst)


def upload(local_path: str, dst: str) -> None:
  """Copies a finished local file to `dst` (local or gs://)."""
  if is_gcs(dst):
    _blob(dst).upload_from_filename(local_path)
  elif os.path.abspath(local_path) != os.path.abspath(dst):
    shutil.copyfile(local_path, dst)


def remove(path: str) -> None:
  if is_gcs(path):
    _blob(path).delete()
  else:
    os.remove(path)


def make_dirs(path: str) -> None:
  if not is_gcs(path):  # GCS has no directories.
    os.makedirs(path, exist_ok=True)


def same_dir(a: str, b: str) -> bool:
  """Whether two directory paths name the same place (local paths after resolving links)."""
  if is_gcs(a) or is_gcs(b):
    return a.rstrip("/") == b.rstrip("/")
  return os.path.realpath(a) == os.path.realpath(b)
