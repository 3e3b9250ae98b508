"""A small streaming safetensors reader and writer (one tensor at a time, local files or gs://).

Format: an 8-byte little-endian header length N, then N bytes of JSON
`{name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
raw little-endian data; offsets are relative to the end of the header. A checkpoint directory holds one
`model.safetensors`, or shards named in `model.safetensors.index.json` (`{"weight_map": {name: file}}`).

The reader fetches only the byte range of the tensor asked for, so loading never needs more host memory
than the largest tensor; `READ_STATS` records the largest single read so tests can check that bound.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from rlver_jax.models.io import storage

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_CODES = {v: k for k, v in _DTYPES.items()}

# Largest single tensor-data read (bytes) and totals since the last reset; headers are not counted.
READ_STATS = {"max_bytes": 0, "total_bytes": 0, "reads": 0}


def reset_read_stats() -> None:
  READ_STATS.update(max_bytes=0, total_bytes=0, reads=0)


def dtype_code(dtype) -> str:
  dt = np.dtype(dtype)
  if dt not in _CODES:
    raise ValueError(f"safetensors: dtype {dt} is not supported (use float32, bfloat16 or float16)")
  return _CODES[dt]


def numpy_dtype(code: str) -> np.dtype:
  """The numpy dtype of a safetensors dtype code ("F32", "BF16", "F16")."""
  if code not in _DTYPES:
    raise ValueError(f"safetensors: dtype {code} is not supported (F32, BF16 or F16)")
  return _DTYPES[code]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor lives: file, dtype code, shape and absolute byte range."""
  file: str
  dtype: str
  shape: tuple[int, ...]
  start: int
  end: int

  @property
  def nbytes(self) -> int:
    return self.end - self.start


def read_header(path: str) -> dict[str, TensorInfo]:
  """Tensor table of one .safetensors file (reads only the header)."""
  raw = storage.read_range(path, 0, 8)
  if len(raw) != 8:
    raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
  (n,) = struct.unpack("<Q", raw)
  try:
    header = json.loads(storage.read_range(path, 8, 8 + n))
  except (ValueError, OSError) as e:
    raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
  base = 8 + n
  out = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    begin, end = entry["data_offsets"]
    out[name] = TensorInfo(path, entry["dtype"], tuple(entry["shape"]), base + begin, base + end)
  return out


def open_checkpoint(directory: str) -> tuple[dict[str, TensorInfo], str]:
  """Tensor table of a Hugging Face checkpoint directory (single file or sharded with an index).

  Also returns the file that lists the tensors (the index or the single file), for error messages.
  """
  index_path = storage.join(directory, INDEX_FILE)
  single = storage.join(directory, SINGLE_FILE)
  # With both present (a stale export), the single file wins, as in transformers' loader.
  if storage.exists(single):
    return read_header(single), single
  if storage.exists(index_path):
    weight_map = json.loads(storage.read_bytes(index_path))["weight_map"]
    table = {}
    for shard in sorted(set(weight_map.values())):
      shard_path = storage.join(directory, shard)
      if not storage.exists(shard_path):
        raise FileNotFoundError(f"{shard_path}: shard listed in {INDEX_FILE} is missing")
      table.update(read_header(shard_path))
    return table, index_path
  raise FileNotFoundError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} found")


def read_tensor(info: TensorInfo, name: str = "") -> np.ndarray:
  """Reads one tensor (only its byte range) as a numpy array of the file's dtype."""
  if info.dtype not in _DTYPES:
    raise ValueError(f"{info.file}: tensor {name} has dtype {info.dtype}; supported: {', '.join(_DTYPES)}")
  dtype = _DTYPES[info.dtype]
  expected = int(np.prod(info.shape, dtype=np.int64)) * dtype.itemsize
  if expected != info.nbytes:
    raise ValueError(f"{info.file}: tensor {name} has {info.nbytes} bytes, but shape {list(info.shape)} "
                     f"of {info.dtype} needs {expected}")
  try:
    data = storage.read_range(info.file, info.start, info.end)
  except OSError as e:
    raise ValueError(f"{info.file}: cannot read tensor {name} ({e})") from None
  if len(data) != info.nbytes:
    raise ValueError(f"{info.file}: tensor {name} needs bytes {info.start}-{info.end}, the file ends "
                     f"before that (truncated?)")
  READ_STATS["max_bytes"] = max(READ_STATS["max_bytes"], len(data))
  READ_STATS["total_bytes"] += len(data)
  READ_STATS["reads"] += 1
  return np.frombuffer(data, dtype=dtype).reshape(info.shape)


@dataclasses.dataclass(frozen=True)
class Entry:
  """A tensor to be written: name, safetensors dtype code and shape (the data comes later, in order)."""
  name: str
  dtype: str
  shape: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * _DTYPES[self.dtype].itemsize


def plan_shards(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
  """Greedy split in order; a tensor larger than the limit gets a shard of its own."""
  shards: list[list[Entry]] = [[]]
  size = 0
  for e in entries:
    if shards[-1] and size + e.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(e)
    size += e.nbytes
  return shards


def shard_names(num_shards: int) -> list[str]:
  if num_shards == 1:
    return [SINGLE_FILE]
  return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def write_file(path: str, entries: list[Entry], arrays: Iterable[np.ndarray]) -> None:
  """Writes a local .safetensors file; `arrays` yields each entry's data in order, one at a time."""
  header, offset = {}, 0
  for e in entries:
    header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
    offset += e.nbytes
  header["__metadata__"] = {"format": "pt"}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # Data starts 8-byte aligned, as the reference writer does.
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    it: Iterator[np.ndarray] = iter(arrays)
    for e in entries:
      a = next(it)
      if tuple(a.shape) != e.shape or dtype_code(a.dtype) != e.dtype:
        raise ValueError(f"{path}: tensor {e.name} is {a.dtype}{list(a.shape)}, "
                         f"planned {e.dtype}{list(e.shape)}")
      f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)  # bf16 has no buffer format.
