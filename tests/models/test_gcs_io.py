"""gs:// checkpoints through an in-memory stand-in for the google-cloud-storage client.

The stand-in follows the client calls storage.py makes (inclusive byte ranges, prefix + delimiter
listing); a real emulator run needs `STORAGE_EMULATOR_HOST` and is not part of this file.
"""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from hf_checkpoints import make_hf_checkpoint, torch_logits
from rlver_jax.models import embedded, export_pretrained, load_pretrained
from rlver_jax.models.io import storage
from rlver_jax.models.io import safetensors as st
from rlver_jax.models.tokenizer import load_tokenizer


class _Blob:
  def __init__(self, store, name):
    self.store, self.name = store, name

  def exists(self):
    return self.name in self.store

  def download_as_bytes(self, start=None, end=None):
    data = self.store[self.name]
    if start is None:
      return data
    return data[start:end + 1]  # GCS ranges include `end`.

  def download_to_filename(self, path):
    with open(path, "wb") as f:
      f.write(self.store[self.name])

  def upload_from_filename(self, path):
    with open(path, "rb") as f:
      self.store[self.name] = f.read()

  def delete(self):
    del self.store[self.name]


class _Client:
  def __init__(self):
    self.buckets: dict[str, dict[str, bytes]] = {}

  def bucket(self, name):
    store = self.buckets.setdefault(name, {})
    return type("Bucket", (), {"blob": lambda _, n: _Blob(store, n)})()

  def list_blobs(self, bucket, prefix="", delimiter=None):
    names = sorted(self.buckets.get(bucket, {}))
    for n in names:
      if n.startswith(prefix) and not (delimiter and delimiter in n[len(prefix):]):
        yield _Blob(self.buckets[bucket], n)


@pytest.fixture
def gcs(monkeypatch):
  client = _Client()
  monkeypatch.setattr(storage, "_client", lambda: client)
  return client


def _upload_dir(local, remote):
  for p in sorted(local.iterdir()):
    storage.upload(str(p), storage.join(remote, p.name))


def test_load_and_export_through_gcs(tmp_path, gcs):
  torch_model = make_hf_checkpoint(tmp_path / "ckpt", arch="qwen2", tied=False, kv_heads=2,
                                   max_shard_size="40KB")
  _upload_dir(tmp_path / "ckpt", "gs://bucket/ckpt")
  st.reset_read_stats()
  model, config = load_pretrained("gs://bucket/ckpt", dtype=jnp.float32)
  table, _ = st.open_checkpoint("gs://bucket/ckpt")
  assert st.READ_STATS["max_bytes"] <= max(t.nbytes for t in table.values())
  ids = np.arange(2, 14).reshape(2, 6)
  ref = torch_logits(torch_model, ids)
  ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
  assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()

  (tmp_path / "tok").mkdir()
  (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
  export_pretrained(model, config, "gs://bucket/out", max_shard_bytes=50_000,
                    tokenizer_dir=str(tmp_path / "tok"))
  names = storage.list_dir("gs://bucket/out")
  assert "config.json" in names and st.INDEX_FILE in names and "tokenizer_config.json" in names
  with pytest.raises(FileExistsError):
    export_pretrained(model, config, "gs://bucket/out")
  again, _ = load_pretrained("gs://bucket/out", dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(again.layers.wq[...]), np.asarray(model.layers.wq[...]))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_pretrained("gs://bucket/nothing")


def test_load_tokenizer_through_gcs(gcs):
  local = embedded.embedded_model_dir()
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    storage.upload(os.path.join(local, name), f"gs://bucket/smol/{name}")
  tok = load_tokenizer("gs://bucket/smol")
  assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
  assert tok.chat_template == load_tokenizer(local).chat_template


def test_generate_accepts_a_gcs_checkpoint(tmp_path, gcs):
  # generate's flag check used os.path.isdir, which refused every gs:// checkpoint.
  from rlver_jax.generate import check_checkpoint
  make_hf_checkpoint(tmp_path / "ckpt", arch="qwen2", tied=True, kv_heads=1)
  _upload_dir(tmp_path / "ckpt", "gs://bucket/ckpt")
  check_checkpoint("gs://bucket/ckpt")
  check_checkpoint(str(tmp_path / "ckpt"))
  with pytest.raises(FileNotFoundError, match="no config.json there"):
    check_checkpoint("gs://bucket/nothing")
  with pytest.raises(FileNotFoundError, match="no such directory"):
    check_checkpoint(str(tmp_path / "nothing"))
