"""Hub ids as checkpoints, offline: `ORG/NAME[@REV]` resolves to its snapshot in a Hugging Face cache
laid out as huggingface_hub lays it out, loads like the directory it was made from, and a model the
cache lacks is one line naming the setting, the id and HF_HUB_OFFLINE."""
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import hub_cache
import tiny_world
from rlver_jax import build
from rlver_jax.models import load_pretrained
from rlver_jax.models.io import hub
from rlver_jax.models.tokenizer import load_tokenizer

COMMIT = hub_cache.commit_hash("tiny-1")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("hub_world"))


@pytest.fixture
def cache(tmp_path, world, monkeypatch):
  """A cache holding org/tiny (main and tag v1 at COMMIT), offline; nothing resolved before."""
  root = tmp_path / "hf_cache"
  hub_cache.add_snapshot(root, "org/tiny", world["policy"], COMMIT, refs=("main", "v1"))
  hub_cache.use_cache(monkeypatch, root)
  monkeypatch.setattr(hub, "_resolved", {})
  return root


def _snapshot(cache):
  return cache / "models--org--tiny" / "snapshots" / COMMIT


@pytest.mark.parametrize("setting", ["org/tiny", f"org/tiny@{COMMIT}", "org/tiny@v1"])
def test_hub_id_resolves_to_its_cached_snapshot_and_loads(cache, world, setting):
  from rlver_jax.generate import check_checkpoint
  path = build.resolve_checkpoint(setting, "policy.checkpoint")
  assert path == str(_snapshot(cache)) and hub.commit_of(path) == COMMIT
  assert check_checkpoint(setting) == path  # generate's --checkpoint
  ids = jnp.asarray([[4, 9, 17, 3, 25]])
  got, _ = load_pretrained(path, dtype=jnp.float32)
  want, _ = load_pretrained(world["policy"], dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(got(ids)), np.asarray(want(ids)))
  assert load_tokenizer(path).encode("try the plan") == load_tokenizer(world["policy"]).encode(
      "try the plan")


@pytest.mark.parametrize("setting", ["org/missing", "org/tiny@v9"])
def test_a_model_the_cache_lacks_offline_is_one_line(cache, setting):
  with pytest.raises(hub.HubError) as e:
    build.resolve_checkpoint(setting, "policy.checkpoint")
  assert str(e.value) == (
      f"config.policy.checkpoint={setting}: no such local directory, it is not in the Hugging Face "
      f"cache {cache}, and HF_HUB_OFFLINE=1 forbids downloading it: download it where the Hub is "
      "reachable (HF_HUB_OFFLINE unset) or point HF_HUB_CACHE at a cache that holds it")


def test_without_network_the_cache_answers(cache, monkeypatch):
  hub_cache.use_cache(monkeypatch, cache, offline=False)  # the Hub refuses connections
  assert build.resolve_checkpoint("org/tiny", "policy.checkpoint") == str(_snapshot(cache))
  with pytest.raises(hub.HubError, match=r"^--checkpoint=org/missing: no such local directory, .* "
                                         r"and the Hub could not be reached: [^\n]*$"):
    build.resolve_checkpoint("org/missing", "--checkpoint")


def test_a_local_directory_named_like_an_id_stays_local(cache, world, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert hub.is_hub_id("org/tiny") and hub.is_hub_id("Qwen/Qwen2.5-7B-Instruct@main")
  shutil.copytree(world["policy"], tmp_path / "org" / "tiny")
  assert not hub.is_hub_id("org/tiny")
  assert build.resolve_checkpoint("org/tiny", "policy.checkpoint") == "org/tiny"
  for path in ("embedded", "gs://b/m", "/abs/m", "./org/x", "runs/a/b", "org/x@"):
    assert not hub.is_hub_id(path), path


def test_downloads_ask_for_what_loading_reads_once(cache, monkeypatch):
  from huggingface_hub.utils import filter_repo_objects
  hub_cache.use_cache(monkeypatch, cache, offline=False)
  calls = []

  def download(repo, **kwargs):
    calls.append((repo, kwargs))
    return str(_snapshot(cache))
  monkeypatch.setattr("huggingface_hub.snapshot_download", download)
  for _ in range(2):  # one run's provenance and loaders: one download, one commit
    assert hub.resolve("org/tiny@v1", "config.policy.checkpoint") == str(_snapshot(cache))
  (repo, kwargs), = calls
  assert (repo, kwargs["revision"], kwargs["cache_dir"]) == ("org/tiny", "v1", str(cache))
  assert not kwargs.get("local_files_only")
  files = ["config.json", "generation_config.json", "model.safetensors",
           "model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
           "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
           "special_tokens_map.json", "chat_template.jinja", "pytorch_model.bin", "model.pt",
           "onnx/model.onnx", "original/consolidated.00.pth", "sub/model.safetensors", "README.md"]
  kept = set(filter_repo_objects(files, allow_patterns=kwargs["allow_patterns"],
                                 ignore_patterns=kwargs["ignore_patterns"]))
  assert kept == set(files[:12])


def test_a_snapshot_without_safetensors_is_refused(cache, world, tmp_path):
  bin_only = tmp_path / "bin_only"
  bin_only.mkdir()
  shutil.copy(f"{world['policy']}/config.json", bin_only)
  (bin_only / "pytorch_model.bin").write_bytes(b"torch")
  hub_cache.add_snapshot(cache, "org/old", str(bin_only), hub_cache.commit_hash("old"))
  with pytest.raises(hub.HubError, match=r"^config\.critic\.checkpoint=org/old: commit [0-9a-f]{40} "
                                         r"of org/old has no safetensors weights"):
    build.resolve_checkpoint("org/old", "critic.checkpoint")


def test_a_training_run_reads_its_policy_from_the_hub_and_records_the_commit(cache, world, tmp_path):
  import json
  from rlver_jax.spec import RunSpec
  config = tiny_world.training_config(world, "grpo", **{"policy.checkpoint": "org/tiny"})
  spec = RunSpec.from_config(config)
  assert "policy.checkpoint" not in build.input_paths(spec)  # each host resolves it from its cache
  trainer = tiny_world.trainer(config, str(tmp_path / "run"))
  assert trainer.policy_path == str(_snapshot(cache))
  start, = json.loads((tmp_path / "run" / "provenance.json").read_text())
  assert start["hub_checkpoints"] == {"policy.checkpoint": {"id": "org/tiny", "commit": COMMIT}}


_HOST = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
from rlver_jax.models.io import hub
try:
  print(json.dumps({"path": hub.resolve("org/tiny", "config.policy.checkpoint")}))
except hub.HubError as e:
  print(json.dumps({"error": str(e)}))
"""


def _two_hosts(caches) -> list[dict]:
  """hub.resolve("org/tiny") on 2 processes (one per host), offline, each with its own cache."""
  import json
  import os
  import subprocess
  import sys
  from gcs_emulator import free_port
  address = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen(
      [sys.executable, "-c", _HOST, str(i), address], stdout=subprocess.PIPE, text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.environ.get("PYTHONPATH", ""),
               HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")) for i, cache in enumerate(caches)]
  try:
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [0, 0], outs
  return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def test_every_host_loads_process_zeros_commit_or_all_stop(world, tmp_path):
  # Host 1's main has moved on (commit B), but it holds A too: it loads A, as host 0 does.
  other = hub_cache.commit_hash("tiny-2")
  cache0, cache1, empty = tmp_path / "c0", tmp_path / "c1", tmp_path / "empty"
  hub_cache.add_snapshot(cache0, "org/tiny", world["policy"], COMMIT)
  hub_cache.add_snapshot(cache1, "org/tiny", world["policy"], COMMIT)
  hub_cache.add_snapshot(cache1, "org/tiny", world["policy"], other)
  got = _two_hosts([cache0, cache1])
  assert [hub.commit_of(g["path"]) for g in got] == [COMMIT, COMMIT], got
  # Host 1 lacks the model: both stop, each with one line (host 1's names why).
  host0, host1 = _two_hosts([cache0, empty])
  assert host0["error"] == (f"config.policy.checkpoint=org/tiny: processes [1] of 2 could not get "
                            f"commit {COMMIT} (their own errors say why)")
  assert host1["error"].startswith(f"config.policy.checkpoint=org/tiny: no such local directory, "
                                   f"it is not in the Hugging Face cache {empty}, and HF_HUB_OFFLINE=1")
  # Host 0 lacks it: both stop with host 0's line.
  assert _two_hosts([empty, cache1])[1]["error"].startswith(
      "config.policy.checkpoint=org/tiny: no such local directory, it is not in the Hugging Face "
      f"cache {empty}")


def test_training_with_a_model_the_cache_lacks_stops_with_one_line(world, tmp_path):
  import os
  import subprocess
  import sys
  flags = tiny_world.cli_flags(world, "grpo", str(tmp_path / "run"), 1,
                               **{"policy.checkpoint": "Qwen/Qwen2.5-7B-Instruct"})
  proc = subprocess.run([sys.executable, "-m", "rlver_jax.main", *flags], capture_output=True,
                        text=True, timeout=300, env=dict(
                            os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
                            HF_HUB_CACHE=str(tmp_path / "empty"),
                            PYTHONPATH=os.environ.get("PYTHONPATH", "")))
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: config.policy.checkpoint=Qwen/Qwen2.5-7B-Instruct: no such local directory, it is not "
      f"in the Hugging Face cache {tmp_path / 'empty'}, and HF_HUB_OFFLINE=1 forbids downloading it: "
      "download it where the Hub is reachable (HF_HUB_OFFLINE unset) or point HF_HUB_CACHE at a cache "
      "that holds it")
