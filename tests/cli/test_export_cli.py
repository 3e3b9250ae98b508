"""Exporting a trained policy: transformers loads the HF directory and its logits are the trained
params' logits; the right step and dtype are written; bad input fails with one clear line."""
import json
import os
import pathlib
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny_world
from hf_checkpoints import hf_from_pretrained, torch_logits
from rlver_jax.train import loop as train
from rlver_jax.spec import RunSpec
from rlver_jax.run import trained_policy
from rlver_jax.run.checkpoint import abstract_like
from rlver_jax.models import load_pretrained

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import base  # noqa: E402

IDS = np.random.default_rng(0).integers(0, 30, size=(2, 12))


def _config(world):
  config = base.get_base_config("grpo", think=False, arg=None)
  tiny_world.apply(config, tiny_world.tiny_overrides(world, "grpo"))
  tiny_world.apply(config, {"total_steps": 2, "checkpoint.every_steps": 1})
  return config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 2-step GRPO run on the tiny world, checkpoints at steps 1 and 2."""
  root = tmp_path_factory.mktemp("export")
  world = tiny_world.make_world(root / "world")
  workdir = root / "run"
  train.run(RunSpec.from_config(_config(world)), str(workdir))
  return {"world": world, "workdir": str(workdir), "root": root}


def _trained_params(run, step):
  """The policy params of `step`, restored the trainer's way (the whole state)."""
  trainer = tiny_world.trainer(_config(run["world"]), run["workdir"])
  state, _ = trainer.checkpointer.restore(abstract_like(trainer.state.checkpointed()), step)
  trainer.checkpointer.close()
  trainer.writer.close()
  nnx.update(trainer.policy, state["policy"])
  return trainer.policy


def _logits(model) -> np.ndarray:
  return np.asarray(model(jnp.asarray(IDS, jnp.int32)))


def _safetensors_dtypes(out_dir) -> set[str]:
  with open(pathlib.Path(out_dir) / "model.safetensors", "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
  return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_export_matches_trained_params(run, tmp_path):
  out = tmp_path / "hf"
  assert trained_policy.export(run["workdir"], str(out)) == 2  # the latest step
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
  ref = torch_logits(hf_from_pretrained(out), IDS)
  ours = _logits(_trained_params(run, 2))
  err = np.abs(ours - ref).max()
  assert err <= 1e-4 * np.abs(ref).max(), err
  initial, _ = load_pretrained(run["world"]["policy"], dtype=jnp.float32)
  assert np.abs(_logits(initial) - ref).max() > 100 * err + 1e-6  # training changed the policy
  assert _safetensors_dtypes(out) == {"F32"}  # the base checkpoint's dtype


def test_export_step_and_dtype(run, tmp_path):
  out1, out2 = tmp_path / "s1", tmp_path / "s2"
  assert trained_policy.export(run["workdir"], str(out1), step=1) == 1
  trained_policy.export(run["workdir"], str(out2), step=2, dtype="bfloat16")
  step1, _ = load_pretrained(str(out1), dtype=jnp.float32)
  np.testing.assert_allclose(_logits(step1), _logits(_trained_params(run, 1)), rtol=1e-5, atol=1e-5)
  assert _safetensors_dtypes(out2) == {"BF16"}
  assert json.loads((out2 / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_errors(run, tmp_path):
  with pytest.raises(ValueError, match="not a training workdir"):
    trained_policy.export(str(tmp_path / "nothing"), str(tmp_path / "o1"))
  bare = tmp_path / "bare"
  bare.mkdir()
  (bare / "config.json").write_text(pathlib.Path(run["workdir"], "config.json").read_text())
  with pytest.raises(ValueError, match="no checkpoints"):
    trained_policy.export(str(bare), str(tmp_path / "o2"))
  with pytest.raises(ValueError, match=r"step 7 not found .*available: 1, 2"):
    trained_policy.export(run["workdir"], str(tmp_path / "o3"), step=7)
  with pytest.raises(ValueError, match="training workdir"):
    trained_policy.export(run["workdir"], run["workdir"], overwrite=True)
  assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


def test_export_refuses_the_runs_own_base_checkpoint(run, tmp_path):
  # --overwrite onto the base policy used to delete its weights before failing on the tokenizer copy.
  base_dir = pathlib.Path(run["world"]["policy"])
  before = {p.name: p.read_bytes() for p in base_dir.iterdir() if p.is_file()}
  link = tmp_path / "same_base"
  link.symlink_to(base_dir)  # another name for the same directory
  for out in (base_dir, link):
    with pytest.raises(ValueError, match="is the run's policy.checkpoint"):
      trained_policy.export(run["workdir"], str(out), overwrite=True)
  assert {p.name: p.read_bytes() for p in base_dir.iterdir() if p.is_file()} == before


def test_export_pretrained_over_its_own_source(run, tmp_path):
  # Writing a model back over the directory it came from keeps the tokenizer files in place.
  import shutil
  from rlver_jax.models import export_pretrained
  src = tmp_path / "copy"
  shutil.copytree(run["world"]["policy"], src)
  model, config = load_pretrained(str(src), dtype=jnp.float32)
  tokenizer = (src / "tokenizer.json").read_bytes()
  export_pretrained(model, config, str(src), tokenizer_dir=str(src), overwrite=True)
  assert (src / "tokenizer.json").read_bytes() == tokenizer
  again, _ = load_pretrained(str(src), dtype=jnp.float32)
  np.testing.assert_array_equal(_logits(again), _logits(model))


def _cli(*args, env=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu") if env is None else env
  return subprocess.run([sys.executable, "-m", "rlver_jax.export", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


def _last_line(proc) -> str:
  return [l for l in proc.stderr.strip().splitlines() if l.strip()][-1]


def test_cli_prints_its_line_and_nothing_else(run, tmp_path):
  # As a user runs it, without JAX_PLATFORMS: on a machine without a TPU no libtpu start-up lines
  # (when libtpu is installed), and no orbax note that the run's checkpoints are "read only".
  from jax._src import hardware_utils  # jax's own test for a TPU on the PCI bus
  if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
    pytest.skip("a TPU is attached: libtpu starts here by design")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  proc = _cli(f"--workdir={run['workdir']}", f"--out={tmp_path / 'hf'}", env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout == f"exported step 2 of {run['workdir']} to {tmp_path / 'hf'}\n"
  assert proc.stderr == ""


def test_cli_refuses_to_overwrite(run, tmp_path):
  out = tmp_path / "hf"
  proc = _cli(f"--workdir={run['workdir']}", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "exported step 2" in proc.stdout
  before = {n: (out / n).read_bytes() for n in os.listdir(out)}
  proc = _cli(f"--workdir={run['workdir']}", f"--out={out}", "--step=1")
  assert proc.returncode != 0
  assert _last_line(proc).startswith("error: ") and "--overwrite" in _last_line(proc)
  assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
  proc = _cli(f"--workdir={run['workdir']}", f"--out={out}", "--step=5", "--overwrite")
  assert proc.returncode != 0 and "step 5 not found" in _last_line(proc)
  assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
  proc = _cli(f"--workdir={run['workdir']}", f"--out={out}", "--step=1", "--overwrite")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert {n: (out / n).read_bytes() for n in os.listdir(out)} != before


def test_default_export_dtype_follows_the_base(tmp_path):
  from hf_checkpoints import make_hf_checkpoint
  make_hf_checkpoint(tmp_path / "base")  # fp32 weights, config.json names float32
  assert trained_policy.base_dtype(str(tmp_path / "base")) == "float32"
  cfg = json.loads((tmp_path / "base" / "config.json").read_text())
  for key in ("dtype", "torch_dtype"):
    cfg.pop(key, None)
  (tmp_path / "base" / "config.json").write_text(json.dumps(cfg))
  # No dtype named: the stored weights decide (fp32 here), not the reader's bfloat16 assumption.
  assert trained_policy.base_dtype(str(tmp_path / "base")) == "float32"
  cfg["torch_dtype"] = "bfloat16"
  (tmp_path / "base" / "config.json").write_text(json.dumps(cfg))
  assert trained_policy.base_dtype(str(tmp_path / "base")) == "bfloat16"


def test_a_ppo_runs_export_is_its_policy_not_its_critic(run, tmp_path):
  """A PPO checkpoint also holds a critic and two optimizer states: export restores the policy alone."""
  config = tiny_world.training_config(run["world"], "ppo", total_steps=1)
  workdir, out = tmp_path / "ppo", tmp_path / "hf"
  train.run(RunSpec.from_config(config), str(workdir))
  assert trained_policy.export(str(workdir), str(out)) == 1
  trainer = tiny_world.trainer(config, str(workdir))
  assert trainer.restore_if_any()
  trainer.checkpointer.close()
  nnx.update(trainer.policy, trainer.state.policy)
  exported, _ = load_pretrained(str(out), dtype=jnp.float32)
  # (Not bitwise: the trainer's copy is sharded over 8 devices, which changes reduction order.)
  np.testing.assert_allclose(_logits(exported), _logits(trainer.policy), atol=1e-5)
  initial, _ = load_pretrained(run["world"]["policy"], dtype=jnp.float32)
  assert np.abs(_logits(initial) - _logits(exported)).max() > 1e-4  # the trained policy, not the base
