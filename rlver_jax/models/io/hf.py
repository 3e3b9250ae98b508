"""Hugging Face safetensors checkpoints in and out, streamed tensor by tensor in the target shardings.

Shape legend: L layers, D hidden, H query heads, K key/value heads, Dh head dim, F MLP width, V vocabulary.

Hugging Face keeps one torch `Linear` weight [out, in] per layer; our params are stacked over L and laid
out input-first with the heads split out (see `qwen2.param_specs`):
  model.embed_tokens.weight              [V, D]      -> embed            [V, D]
  model.layers.{i}.self_attn.q_proj      [H*Dh, D]   -> layers.wq[i]     [D, H, Dh]   (transpose, split)
  ... k_proj / v_proj                    [K*Dh, D]   -> layers.wk/wv[i]  [D, K, Dh]
  ... q/k/v_proj.bias                    [H*Dh]      -> layers.bq/bk/bv  [H, Dh]
  ... o_proj.weight                      [D, H*Dh]   -> layers.wo[i]     [H, Dh, D]
  ... mlp.gate_proj / up_proj            [F, D]      -> w_gate / w_up    [D, F]
  ... mlp.down_proj                      [D, F]      -> w_down           [F, D]
  ... input_layernorm / post_attention_layernorm     -> attn_norm / mlp_norm [D]
  model.norm.weight -> final_norm; lm_head.weight [V, D] -> lm_head [D, V] (absent when tied).

Loading never holds more than one tensor on the host: a non-stacked param is built with
`make_array_from_callback` from one read; a stacked one starts as zeros in its sharding and each layer
slice is written in place by a jitted, donated `at[i].set`. Export gathers one layer slice at a time.
With `int8_weights` each weight is quantized as it loads (`models/quant.py`), by a jitted function
whose outputs take the int8 param's and its scale's shardings: the float copy is one tensor (or one
layer slice), sharded, at a time.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlver_jax.models import quant
from rlver_jax.models.io import safetensors as st
from rlver_jax.models.io import storage
from rlver_jax.models.factory import abstract_model, state_shardings
from rlver_jax.models.presets import Qwen2Config, from_hf_config, to_hf_config
from rlver_jax.models.qwen2 import Head, ParamSpec, Qwen2, RematPolicy, param_specs
from rlver_jax.parallel.process_zero import on_process_zero
from rlver_jax.parallel.sharding import DEFAULT_RULES, ShardingRules

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")
_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class CheckpointError(ValueError):
  """A checkpoint that does not match its config.json (missing tensor, wrong shape)."""


@dataclasses.dataclass(frozen=True)
class _Mapping:
  """How one of our params is stored by Hugging Face; `{i}` in the name stands for the layer."""
  hf_name: str
  hf_shape: tuple[int, ...]
  transpose: bool  # torch Linear weights are [out, in]; ours are input-first.

  def name(self, layer: int | None) -> str:
    return self.hf_name if layer is None else self.hf_name.format(i=layer)

  def to_ours(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return (w.T if self.transpose else w).reshape(shape)  # A view: the copy happens per shard.

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    return x.reshape(self.hf_shape[::-1]).T if self.transpose else x.reshape(self.hf_shape)


def hf_mappings(config: Qwen2Config, head: Head = "lm") -> dict[str, _Mapping]:
  """Our param path -> its Hugging Face tensor, for every param a checkpoint holds."""
  c = config
  D, F, V, q, kv = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_heads * c.head_dim, \
      c.num_kv_heads * c.head_dim
  layer = "model.layers.{i}."
  table = {
      "embed": _Mapping("model.embed_tokens.weight", (V, D), False),
      "layers.attn_norm": _Mapping(layer + "input_layernorm.weight", (D,), False),
      "layers.wq": _Mapping(layer + "self_attn.q_proj.weight", (q, D), True),
      "layers.bq": _Mapping(layer + "self_attn.q_proj.bias", (q,), False),
      "layers.wk": _Mapping(layer + "self_attn.k_proj.weight", (kv, D), True),
      "layers.bk": _Mapping(layer + "self_attn.k_proj.bias", (kv,), False),
      "layers.wv": _Mapping(layer + "self_attn.v_proj.weight", (kv, D), True),
      "layers.bv": _Mapping(layer + "self_attn.v_proj.bias", (kv,), False),
      "layers.wo": _Mapping(layer + "self_attn.o_proj.weight", (D, q), True),
      "layers.mlp_norm": _Mapping(layer + "post_attention_layernorm.weight", (D,), False),
      "layers.w_gate": _Mapping(layer + "mlp.gate_proj.weight", (F, D), True),
      "layers.w_up": _Mapping(layer + "mlp.up_proj.weight", (F, D), True),
      "layers.w_down": _Mapping(layer + "mlp.down_proj.weight", (D, F), True),
      "final_norm": _Mapping("model.norm.weight", (D,), False),
      "lm_head": _Mapping("lm_head.weight", (V, D), True),
  }
  # Ordered as Hugging Face orders a layer; only params this model has (biases, untied head).
  return {k: m for k, m in table.items() if k in param_specs(config, head)}


def _layers_of(key: str, config: Qwen2Config) -> list[int | None]:
  return list(range(config.num_layers)) if key.startswith("layers.") else [None]


# -- loading ------------------------------------------------------------------------------------------


def read_config(path: str) -> Qwen2Config:
  """The architecture of the HF checkpoint directory `path` (local or gs://), from its config.json:
  the one reader of a checkpoint's config (errors name the file)."""
  config_path = storage.join(str(path), CONFIG_FILE)
  if not storage.exists(config_path):
    raise FileNotFoundError(f"{config_path}: missing; not a Hugging Face checkpoint directory")
  return from_hf_config(json.loads(storage.read_bytes(config_path)), source=config_path)


def load_pretrained(path: str, dtype=jnp.bfloat16, mesh: Mesh | None = None, *,
                    rules: ShardingRules = DEFAULT_RULES, head: Head = "lm", param_dtype=None,
                    remat: RematPolicy = "none", int8_weights: bool = False) -> tuple[Qwen2, Qwen2Config]:
  """Loads a Hugging Face Qwen2/Llama safetensors directory (local or gs://) as `(model, config)`.

  `dtype` is the compute dtype and, unless `param_dtype` says otherwise, the param dtype. With `mesh`,
  every param is created directly in the sharding `rules` give it; without, on the default device. A
  value-head model (`head="value"`) gets a zero value head and ignores the checkpoint's LM head.
  `int8_weights` (a frozen model) quantizes the linear weights as they load (`models/quant.py`).
  """
  path = str(path)
  if not storage.exists(path):
    raise FileNotFoundError(f"{path}: checkpoint directory does not exist")
  config = read_config(path)
  param_dtype = dtype if param_dtype is None else param_dtype
  table, listing = st.open_checkpoint(path)
  mappings = hf_mappings(config, head)
  _check_tensors(table, listing, mappings, config)
  _check_unused(path, table, config)

  graphdef, abstract = nnx.split(abstract_model(config, head=head, param_dtype=param_dtype, dtype=dtype,
                                                remat=remat, int8_weights=int8_weights))
  if mesh is not None:
    by_path = nnx.to_flat_state(state_shardings(abstract, mesh, rules))
    shardings = {_key(p): v.get_value() for p, v in by_path}
  else:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = {_key(p): device for p, _ in nnx.to_flat_state(abstract)}
  specs = param_specs(config, head)
  values = {}
  for p, var in nnx.to_flat_state(abstract):
    key = _key(p)
    if key in values:  # a scale, loaded with its weight
      continue
    if key in mappings and int8_weights and key in quant.INPUT_AXES:
      scale_key = key + quant.SCALE_SUFFIX
      values[key], values[scale_key] = _load_param(
          table, mappings[key], specs[key], (shardings[key], shardings[scale_key]), config,
          param_dtype, quantize_dims=quant.input_dims(key, specs[key].logical_axes))
    elif key in mappings:
      values[key] = _load_param(table, mappings[key], specs[key], shardings[key], config, param_dtype)
    else:  # The value head: not in Hugging Face checkpoints.
      values[key] = jax.jit(functools.partial(jnp.zeros, var.shape, param_dtype),
                            out_shardings=shardings[key])()
  loaded = [(p, var.replace(values[_key(p)])) for p, var in nnx.to_flat_state(abstract)]
  return nnx.merge(graphdef, nnx.from_flat_state(loaded)), config


def _key(path: tuple) -> str:
  return ".".join(str(p) for p in path)


def _check_tensors(table: dict[str, st.TensorInfo], listing: str, mappings: dict[str, _Mapping],
                   config: Qwen2Config) -> None:
  """Fails before any loading if a tensor is missing or has the wrong shape."""
  for key, m in mappings.items():
    for layer in _layers_of(key, config):
      name = m.name(layer)
      if name not in table:
        raise CheckpointError(f"{listing}: tensor {name} is missing (needed for {key})")
      info = table[name]
      if info.shape != m.hf_shape:
        raise CheckpointError(f"{info.file}: tensor {name} has shape {list(info.shape)}, "
                              f"config.json implies {list(m.hf_shape)}")


def _check_unused(path: str, table: dict[str, st.TensorInfo], config: Qwen2Config) -> None:
  """Fails if the checkpoint holds tensors config.json does not account for.

  Such a config.json describes another model (fewer layers, Llama without Qwen2's biases) and would load
  as one. Rotary inv_freq buffers (older checkpoints) are recomputed, not loaded, by transformers too.
  """
  used = {m.name(layer) for key, m in hf_mappings(config, "lm").items() for layer in _layers_of(key, config)}
  unused = sorted(n for n in table if n not in used and not n.endswith(".inv_freq"))
  if config.tie_word_embeddings and "lm_head.weight" in unused:
    # transformers ties only when both are equal (e.g. torch .bin exports); otherwise it keeps the
    # separate head, a model a tied config.json does not describe.
    embed = table[hf_mappings(config)["embed"].hf_name]
    if not _same_values(table["lm_head.weight"], embed):
      raise CheckpointError(f"{path}: config.json sets tie_word_embeddings=true but lm_head.weight differs "
                            "from model.embed_tokens.weight (transformers would not tie them)")
    unused.remove("lm_head.weight")
  if unused:
    shown = ", ".join(unused[:3]) + (", ..." if len(unused) > 3 else "")
    raise CheckpointError(f"{path}: {len(unused)} tensor(s) not used by its config.json ({shown}); "
                          "config.json does not describe these weights")


def _same_values(a: st.TensorInfo, b: st.TensorInfo, chunk_bytes: int = 64 << 20) -> bool:
  """Whether two tensors hold equal values, read a block of rows at a time (never a whole tensor)."""
  if a.shape != b.shape or not a.shape:
    return False
  da, db = st.numpy_dtype(a.dtype), st.numpy_dtype(b.dtype)
  row_elems = int(np.prod(a.shape[1:], dtype=np.int64))
  rows = max(1, chunk_bytes // (row_elems * max(da.itemsize, db.itemsize)))
  for r in range(0, a.shape[0], rows):
    n = min(rows, a.shape[0] - r)
    blocks = []
    for info, dt in ((a, da), (b, db)):
      start = info.start + r * row_elems * dt.itemsize
      data = storage.read_range(info.file, start, start + n * row_elems * dt.itemsize)
      blocks.append(np.frombuffer(data, dtype=dt).astype(np.float32))
    if blocks[0].shape != blocks[1].shape or not np.array_equal(blocks[0], blocks[1]):
      return False
  return True


def _load_param(table, mapping: _Mapping, spec: ParamSpec, sharding, config: Qwen2Config, param_dtype,
                quantize_dims: tuple[int, ...] | None = None):
  """The param in its sharding; with `quantize_dims` (its input dims), `sharding` is a pair and the
  result is (int8 values, fp32 scale), each layer slice quantized on its devices as it lands."""
  np_dtype = np.dtype(param_dtype)
  stacked = spec.logical_axes[:1] == ("layers",)

  def host_view(layer: int | None) -> np.ndarray:
    name = mapping.name(layer)
    shape = spec.shape if layer is None else spec.shape[1:]
    return mapping.to_ours(st.read_tensor(table[name], name), shape)

  if quantize_dims is not None:
    np_dtype = np.dtype(np.float32)  # one tensor or layer at a time, quantized from full precision
    slice_dims = tuple(d - 1 for d in quantize_dims) if stacked else quantize_dims
    to_int8 = jax.jit(functools.partial(quant.quantize, dims=slice_dims),
                      out_shardings=tuple(map(_without_leading_axis, sharding)) if stacked else sharding)
  if not stacked:
    value = _put(host_view(None), sharding if quantize_dims is None else sharding[0], np_dtype)
    return value if quantize_dims is None else to_int8(value)
  if quantize_dims is None:
    out = jax.jit(functools.partial(jnp.zeros, spec.shape, param_dtype), out_shardings=sharding)()
    layer_sharding = _without_leading_axis(sharding)
  else:
    scale_shape = tuple(n for d, n in enumerate(spec.shape) if d not in quantize_dims)
    out = jax.jit(lambda: (jnp.zeros(spec.shape, jnp.int8), jnp.zeros(scale_shape, jnp.float32)),
                  out_shardings=sharding)()
    layer_sharding = _without_leading_axis(sharding[0])
  set_layer = jax.jit(_set_layer, donate_argnums=0, out_shardings=sharding)
  for i in range(config.num_layers):
    layer = _put(host_view(i), layer_sharding, np_dtype)
    out = set_layer(out, layer if quantize_dims is None else to_int8(layer), np.int32(i))
  return out


def _set_layer(stacked, layer, i: jax.Array):
  """Layer i of a stacked param (or of an (int8, scale) pair) set in place."""
  return jax.tree.map(lambda s, x: s.at[i].set(x), stacked, layer)


def _put(host: np.ndarray, sharding: jax.sharding.Sharding, np_dtype: np.dtype) -> jax.Array:
  """One host tensor into its sharding; each device copies (and casts) only its own slice."""
  return jax.make_array_from_callback(host.shape, sharding,
                                      lambda index: np.asarray(host[index], dtype=np_dtype))


def _without_leading_axis(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
  return sharding


# -- export -------------------------------------------------------------------------------------------


def export_pretrained(model: Qwen2, config: Qwen2Config, out_dir: str, *, tokenizer_dir: str | None = None,
                      max_shard_bytes: int = 2**31, dtype=None, overwrite: bool = False) -> None:
  """Writes `model` as a Hugging Face checkpoint (config.json, safetensors, tokenizer files).

  All processes must call this (they take part in gathering each tensor); only process 0 writes. `dtype`
  defaults to the params' dtype. A gs:// `out_dir` is written file by file through a local temp dir.
  """
  if model.head != "lm":
    raise ValueError("export_pretrained: only LM-head (policy) models have a Hugging Face layout; "
                     f"this model has head={model.head!r}")
  out_dir = str(out_dir)
  writer = jax.process_index() == 0
  keep_tokenizer = tokenizer_dir is not None and storage.same_dir(str(tokenizer_dir), out_dir)
  _prepare_out_dir(out_dir, overwrite, keep_tokenizer)
  params = {_key(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  out_dtype = np.dtype(params["embed"].dtype if dtype is None else dtype)
  code = st.dtype_code(out_dtype)

  mappings = hf_mappings(config, "lm")
  items = _export_order(mappings, config)
  entries = [st.Entry(mappings[key].name(layer), code, mappings[key].hf_shape) for key, layer in items]
  shards = st.plan_shards(entries, max_shard_bytes)
  names = st.shard_names(len(shards))

  start = 0
  for shard, name in zip(shards, names):
    tensors = _hf_tensors(params, mappings, items[start:start + len(shard)], out_dtype)
    start += len(shard)

    def write_shard(shard=shard, name=name, tensors=tensors) -> None:
      try:
        _write_out(out_dir, name, lambda p: st.write_file(p, shard, tensors))
      finally:  # the gathers a failed write did not reach: the other processes join every one
        if jax.process_count() > 1:
          collections.deque(tensors, maxlen=0)
    if not writer:
      collections.deque(tensors, maxlen=0)  # every process joins each gather
    on_process_zero(f"writing {storage.join(out_dir, name)}", write_shard)

  on_process_zero(f"writing the index, config and tokenizer into {out_dir}", functools.partial(
      _write_index_and_config, out_dir, shards, names, config, code, tokenizer_dir))


def _hf_tensors(params: dict, mappings: dict[str, _Mapping], shard_items, out_dtype):
  """The Hugging Face tensors of one shard's (key, layer) items, in order, gathered to the host.

  Every process joins every tensor's gather: a conversion error is raised only after the shard's last
  gather, so a process-0-only failure leaves no host waiting in one.
  """
  error = None
  for key, layer in shard_items:
    x = _fetch(params[key] if layer is None else _take_layer(params[key], np.int32(layer)))
    if error is None:
      try:
        converted = mappings[key].to_hf(x.astype(out_dtype))
      except Exception as e:
        error = e
        continue
      yield converted
  if error is not None:
    raise error


def _write_index_and_config(out_dir: str, shards, names, config: Qwen2Config, code: str,
                            tokenizer_dir) -> None:
  """Process 0's last files: the shard index (when sharded), config.json and the tokenizer."""
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(e.nbytes for shard in shards for e in shard)},
             "weight_map": {e.name: n for shard, n in zip(shards, names) for e in shard}}
    _write_text(out_dir, st.INDEX_FILE, json.dumps(index, indent=2))
  hf_config = to_hf_config(dataclasses.replace(config, checkpoint_dtype=_DTYPE_NAMES[code]))
  _write_text(out_dir, CONFIG_FILE, json.dumps(hf_config, indent=2))
  if tokenizer_dir is not None:
    _copy_tokenizer(str(tokenizer_dir), out_dir)


def _export_order(mappings: dict[str, _Mapping], config: Qwen2Config) -> list[tuple[str, int | None]]:
  """embed, then layer by layer, then the final norm and LM head (the order Hugging Face writes)."""
  stacked = [k for k in mappings if k.startswith("layers.")]
  items: list[tuple[str, int | None]] = [("embed", None)]
  items += [(k, i) for i in range(config.num_layers) for k in stacked]
  items += [(k, None) for k in mappings if k not in stacked and k != "embed"]
  return items


@jax.jit
def _take_layer(stacked: jax.Array, i: jax.Array) -> jax.Array:
  return jax.lax.dynamic_index_in_dim(stacked, i, keepdims=False)


def _fetch(x: jax.Array) -> np.ndarray:
  """The whole array on the host of every process (collective when it spans processes)."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _export_file(name: str) -> bool:
  """A file some export writes (weights, index, config, tokenizer); overwriting removes only these."""
  return (name.endswith(".safetensors") or name in (st.INDEX_FILE, CONFIG_FILE)
          or name in TOKENIZER_FILES)


def _prepare_out_dir(out_dir: str, overwrite: bool, keep_tokenizer: bool = False) -> None:
  existing = storage.list_dir(out_dir)
  if existing and not overwrite:
    raise FileExistsError(f"{out_dir}: output directory is not empty ({len(existing)} entries); "
                          "pass overwrite=True to write over it")

  def prepare() -> None:
    storage.make_dirs(out_dir)
    # Overwriting: nothing of an earlier export (other shard count, other tokenizer's files) may survive
    # next to the new one; files the user put there stay.
    for name in existing:
      if _export_file(name) and not (keep_tokenizer and name in TOKENIZER_FILES):  # its own source
        storage.remove(storage.join(out_dir, name))
  on_process_zero(f"preparing {out_dir}", prepare)


def _write_out(out_dir: str, name: str, write: Callable[[str], None]) -> None:
  """Writes one file with `write(local_path)`, then moves it into `out_dir` (uploading for gs://)."""
  if not storage.is_gcs(out_dir):
    write(os.path.join(out_dir, name))
    return
  with tempfile.TemporaryDirectory() as tmp:
    local = os.path.join(tmp, name)
    write(local)
    storage.upload(local, storage.join(out_dir, name))


def _write_text(out_dir: str, name: str, text: str) -> None:
  def write(p: str) -> None:
    with open(p, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  _write_out(out_dir, name, write)


def _copy_tokenizer(tokenizer_dir: str, out_dir: str) -> None:
  if storage.same_dir(tokenizer_dir, out_dir):  # written over its own source: files already there
    return
  present = set(storage.list_dir(tokenizer_dir))
  for name in TOKENIZER_FILES:
    if name in present:
      _write_out(out_dir, name, lambda p, n=name: storage.copy_to_local(storage.join(tokenizer_dir, n), p))
