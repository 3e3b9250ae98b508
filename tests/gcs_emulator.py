"""A local GCS for tests: gcp-storage-emulator on a free loopback port, in a thread of this process.

Processes that should use it get `env(url)`; this process talks to it through `client(url)`, so its
own environment (and every cached client in it) stays untouched.
"""
from __future__ import annotations

import contextlib
import logging
import pathlib
import socket
from typing import Iterator


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _send_generation_headers() -> None:
  """Object downloads carry x-goog-generation, as real GCS sends it.

  tensorstore (orbax's array writer) reads an object's generation from that header and fails with
  "Malformed StorageGeneration" without it; the emulator (2026.7.19) leaves it out.
  """
  from gcp_storage_emulator import server
  from gcp_storage_emulator.handlers import objects
  original = objects.download
  if getattr(original, "sends_generation", False):
    return

  def download(request, response, storage, *args, **kwargs):
    original(request, response, storage, *args, **kwargs)
    try:
      obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # not found: the original handler has answered 404 already
      return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj["metageneration"])

  download.sends_generation = True
  for _, handlers in server.HANDLERS:
    for method, fn in list(handlers.items()):
      if fn is original:
        handlers[method] = download
  objects.download = download  # objects.get calls it by name for ?alt=media


@contextlib.contextmanager
def running(bucket: str) -> Iterator[str]:
  """Starts an in-memory emulator holding `bucket`; yields its URL."""
  from gcp_storage_emulator.server import create_server
  _send_generation_headers()
  logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # 404s are expected
  port = free_port()
  server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
  server.start()
  try:
    yield f"http://127.0.0.1:{port}"
  finally:
    server.stop()


def env(url: str) -> dict[str, str]:
  """What a child process needs to use the emulator: only the variable users set themselves."""
  return {"STORAGE_EMULATOR_HOST": url}


def client(url: str):
  from google.auth.credentials import AnonymousCredentials
  from google.cloud import storage
  return storage.Client(project="test", credentials=AnonymousCredentials(),
                        client_options={"api_endpoint": url})


def upload_dir(client, local: pathlib.Path, gs_dir: str) -> None:
  """Copies the files directly inside `local` to gs://bucket/prefix/NAME."""
  bucket, _, prefix = gs_dir[len("gs://"):].partition("/")
  for p in sorted(local.iterdir()):
    if p.is_file():
      client.bucket(bucket).blob(f"{prefix}/{p.name}").upload_from_filename(str(p))


def names(client, gs_dir: str) -> list[str]:
  """Every object name under gs://bucket/prefix, relative to it."""
  bucket, _, prefix = gs_dir[len("gs://"):].partition("/")
  prefix = prefix.rstrip("/") + "/"
  return sorted(b.name[len(prefix):] for b in client.list_blobs(bucket, prefix=prefix))


def read_text(client, gs_path: str) -> str:
  bucket, _, name = gs_path[len("gs://"):].partition("/")
  return client.bucket(bucket).blob(name).download_as_text()
