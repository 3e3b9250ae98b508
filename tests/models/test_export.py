"""export_pretrained round trips: transformers reads what we write, and so do we."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_checkpoints import hf_from_pretrained, torch_logits
from rlver_jax.models import Qwen2Config, create_model, export_pretrained, load_pretrained
from rlver_jax.models.io import safetensors as st
from rlver_jax.models.tokenizer import QWEN25_DEFAULT_SYSTEM
from rlver_jax.parallel.sharding import MeshConfig, make_mesh

IDS = np.random.default_rng(1).integers(0, 96, size=(2, 10))


def _config(qkv_bias: bool, tied: bool) -> Qwen2Config:
  return Qwen2Config(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=12 if qkv_bias else 16, rope_theta=1e4, rms_norm_eps=1e-6,
                     tie_word_embeddings=tied, qkv_bias=qkv_bias, max_position_embeddings=64,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0, checkpoint_dtype="float32")


def _params(model) -> dict[str, np.ndarray]:
  return {".".join(map(str, p)): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _hf_logits(out_dir) -> np.ndarray:
  return torch_logits(hf_from_pretrained(out_dir), IDS)


@pytest.mark.parametrize("qkv_bias,tied", [(True, False), (False, True)], ids=["qwen2-untied", "llama-tied"])
def test_transformers_reads_export(tmp_path, qkv_bias, tied):
  config = _config(qkv_bias, tied)
  # Biases are zero-initialised; give them values so the round trip checks their layout too.
  model = create_model(config, dtype=jnp.float32, init_std=0.1, seed=3)
  if qkv_bias:
    for name in ("bq", "bk", "bv"):
      var = getattr(model.layers, name)
      var.set_value(0.1 * jnp.ones_like(var.get_value()).cumsum(-1) / var.get_value().shape[-1])
  export_pretrained(model, config, tmp_path / "out")
  files = sorted(os.listdir(tmp_path / "out"))
  assert files == ["config.json", "model.safetensors"]
  ours = np.asarray(model(jnp.asarray(IDS, jnp.int32)))
  ref = _hf_logits(tmp_path / "out")
  err = np.abs(ours - ref).max()
  print(f"export {qkv_bias=} {tied=}: max|dlogit| = {err:.2e}, max|logit| = {np.abs(ref).max():.2f}")
  assert err <= 1e-4 * np.abs(ref).max()
  reloaded, config2 = load_pretrained(str(tmp_path / "out"), dtype=jnp.float32)
  assert config2 == config
  for key, value in _params(model).items():
    np.testing.assert_array_equal(_params(reloaded)[key], value, err_msg=key)


def test_sharded_model_sharded_files(tmp_path):
  config = _config(qkv_bias=True, tied=False)
  mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
  model = create_model(config, mesh=mesh, dtype=jnp.float32, init_std=0.1, seed=4)
  tok = tmp_path / "tok"
  tok.mkdir()
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "unrelated.txt"):
    (tok / name).write_text("{}")
  out = tmp_path / "out"
  export_pretrained(model, config, out, tokenizer_dir=str(tok), max_shard_bytes=40_000)
  index = json.loads((out / st.INDEX_FILE).read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(out))
  assert "unrelated.txt" not in os.listdir(out)
  for shard in shards:
    assert os.path.getsize(out / shard) <= 40_000 + 4096  # + header
  with jax.set_mesh(mesh):
    ours = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(IDS, jnp.int32)))
  ref = _hf_logits(out)
  assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def test_bf16_export(tmp_path):
  config = _config(qkv_bias=False, tied=False)
  model = create_model(config, dtype=jnp.float32, init_std=0.1)
  export_pretrained(model, config, tmp_path, dtype=jnp.bfloat16)
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  table, _ = st.open_checkpoint(str(tmp_path))
  assert {info.dtype for info in table.values()} == {"BF16"}
  reloaded, _ = load_pretrained(str(tmp_path), dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(reloaded.layers.w_up[...]),
                                np.asarray(model.layers.w_up[...].astype(jnp.bfloat16).astype(jnp.float32)))


def test_refuses_non_empty_dir_and_value_heads(tmp_path):
  config = _config(qkv_bias=False, tied=True)
  model = create_model(config, dtype=jnp.float32)
  (tmp_path / "notes.txt").write_text("keep me")
  with pytest.raises(FileExistsError, match="not empty"):
    export_pretrained(model, config, tmp_path)
  export_pretrained(model, config, tmp_path, overwrite=True)
  assert (tmp_path / "notes.txt").exists() and (tmp_path / "model.safetensors").exists()
  critic = create_model(config, dtype=jnp.float32, head="value")
  with pytest.raises(ValueError, match="head='value'"):
    export_pretrained(critic, config, tmp_path / "critic")


def test_overwrite_leaves_nothing_of_the_previous_export(tmp_path):
  # Export A ships SmolLM2's tokenizer (chat_template.jinja); export B over it ships a Qwen2.5 one saved
  # the transformers-4 way (template inside tokenizer_config.json). A stale chat_template.jinja from A
  # would win over B's template, and A's extra files would sit next to B's.
  from rlver_jax.models.embedded import embedded_model_dir
  from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer, qwen25_tokenizer
  smol = embedded_model_dir()
  qwen = tmp_path / "qwen_tok"
  qwen25_tokenizer().save_pretrained(str(qwen))
  if (qwen / "chat_template.jinja").exists():
    template = (qwen / "chat_template.jinja").read_text()
    (qwen / "chat_template.jinja").unlink()
    tok_config = json.loads((qwen / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = template
    (qwen / "tokenizer_config.json").write_text(json.dumps(tok_config))
  (qwen / "generation_config.json").write_text("{}")

  config = _config(qkv_bias=False, tied=True)
  model = create_model(config, dtype=jnp.float32)
  out = tmp_path / "out"
  export_pretrained(model, config, out, tokenizer_dir=smol, max_shard_bytes=40_000)  # sharded
  assert "chat_template.jinja" in os.listdir(out) and st.INDEX_FILE in os.listdir(out)
  (out / "notes.txt").write_text("keep me")
  (out / "extra.json").write_text("{}")  # a user's file that merely looks like an export's
  export_pretrained(model, config, out, tokenizer_dir=str(qwen), overwrite=True)
  tokenizer_files = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                     "special_tokens_map.json", "generation_config.json", "chat_template.jinja"}
  expected = {"config.json", "model.safetensors", "notes.txt", "extra.json"}
  expected |= set(os.listdir(qwen)) & tokenizer_files
  assert set(os.listdir(out)) == expected
  assert ChatTokens(load_tokenizer(str(out))).default_system_prompt == QWEN25_DEFAULT_SYSTEM
  assert load_pretrained(str(out), dtype=jnp.float32)[1] == config


def test_overwrite_over_the_tokenizers_own_dir_keeps_it(tmp_path):
  from rlver_jax.models.embedded import embedded_model_dir
  from rlver_jax.models.tokenizer import load_tokenizer
  import shutil
  config = _config(qkv_bias=False, tied=True)
  model = create_model(config, dtype=jnp.float32)
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(os.path.join(embedded_model_dir(), name), tmp_path / name)
  export_pretrained(model, config, tmp_path, tokenizer_dir=str(tmp_path), overwrite=True)
  assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(tmp_path))
  assert load_tokenizer(str(tmp_path)).chat_template == load_tokenizer(embedded_model_dir()).chat_template


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
  # An export cut short (a crash, a partial copy) must name the file, not fail deep in numpy.
  config = _config(qkv_bias=False, tied=True)
  export_pretrained(create_model(config, dtype=jnp.float32), config, tmp_path)
  weights = tmp_path / "model.safetensors"
  data = weights.read_bytes()
  weights.write_bytes(data[: len(data) - 1000])
  with pytest.raises(ValueError, match=r"model\.safetensors: .*truncated"):
    load_pretrained(str(tmp_path), dtype=jnp.float32)
