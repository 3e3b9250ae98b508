"""AOT compilation for TPU topologies on this CPU machine (needs libtpu; skipped without it).

libtpu describes any TPU slice without a TPU and without initialising a TPU backend, so this runs in the
test process itself, next to JAX_PLATFORMS=cpu and the fake CPU devices.
"""
import importlib.util
import os
import pathlib
import runpy
import sys

import pytest

if importlib.util.find_spec("libtpu") is None:
  pytest.skip('libtpu is not installed (pip install "jax[tpu]==0.12.0.1")', allow_module_level=True)

import jax  # noqa: E402

from rlver_jax.aot import plan as run_plan  # noqa: E402
from rlver_jax.aot import programs as ap  # noqa: E402
from rlver_jax.aot import report as aot  # noqa: E402
from rlver_jax.aot import target as aot_target  # noqa: E402
from rlver_jax.aot import topology  # noqa: E402
from rlver_jax.aot.programs import model_config  # noqa: E402
from rlver_jax.models import presets  # noqa: E402
from rlver_jax.parallel.sharding import MeshConfig, make_mesh  # noqa: E402
from rlver_jax.sampling.kv_cache import KVCache, default_layout  # noqa: E402
from rlver_jax.spec.forward import ModelShape  # noqa: E402

_REPO = pathlib.Path(__file__).resolve().parents[2]
_TPU_ENV = {k: os.environ.get(k) for k in
            ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "ALLOW_MULTIPLE_LIBTPU_LOAD")}
_GET_CONFIG = runpy.run_path(str(_REPO / "configs" / "aot_forward.py"))["get_config"]
_RUN_CONFIGS = {name: runpy.run_path(str(_REPO / "configs" / f"{name}.py"))["get_config"]
                for name in ("grpo_think", "ppo_think", "grpo_nothink")}

# A Qwen2-shaped model small enough that a whole training step's programs compile in seconds (the
# 152k-entry vocabulary alone costs ~20 s per decode program: sorting it for top-p).
_TINY = presets.Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=64, eos_token_id=(1, 2),
                            pad_token_id=0)


@pytest.fixture(scope="module")
def topology_ok():
  # Skip only when jax finds no TPU support; any other get_topology error is a failure.
  try:
    topology.get_topology("v5e:2x2")
  except topology.AotError as e:
    if not str(e).startswith("libtpu is not installed"):
      raise
    pytest.skip(f"libtpu is not usable here: {e}")


def _tiny(batch_size=8, seq_len=128) -> aot_target.ForwardSpec:
  config = _GET_CONFIG("tiny")
  with config.unlocked():
    config.forward.batch_size = batch_size
    config.forward.seq_len = seq_len
  return aot_target.from_config(config)


def _expected_argument_bytes(spec, fsdp: int) -> int:
  """Per-device bytes of bf16 params + int32 ids; every weight with a hidden-size dim is split fsdp ways."""
  c = model_config(spec.model)
  L, D, H, K, Dh, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                          c.intermediate_size, c.vocab_size)
  assert D % fsdp == 0 and not c.tie_word_embeddings
  split = L * (2 * D * H * Dh + 2 * D * K * Dh + 3 * D * F) + 2 * V * D   # weights, embedding, LM head
  whole = L * (2 * D + H * Dh + 2 * K * Dh) + D                          # norms and q/k/v biases
  ids = spec.batch_size * spec.seq_len * 4 // fsdp
  return 2 * (split // fsdp + whole) + ids


def test_forward_fits_and_counts_params(topology_ok):
  spec = _tiny()
  (row,) = aot.report(spec, "v5e:2x2")
  assert row.program == "forward" and row.mesh == (1, 4, 1)
  assert row.fits and row.error is None
  assert row.argument_bytes == pytest.approx(_expected_argument_bytes(spec, fsdp=4), rel=0.01)
  vocab = model_config(spec.model).vocab_size
  assert row.output_bytes == 8 * 128 * vocab * 4 // 4   # fp32 logits, batch split 4 ways
  assert row.hbm_bytes == 16 * 2**30
  assert "| forward | v5e:2x2 | 1x4x1 |" in aot.format_table([row])


def test_over_budget_is_a_row_not_a_crash(topology_ok):
  (row,) = aot.report(_tiny(batch_size=64, seq_len=8192), "v5e:1x1")
  assert not row.fits
  assert "RESOURCE_EXHAUSTED" in row.error
  assert row.total_bytes is None
  assert "| no (RESOURCE_EXHAUSTED" in aot.format_table([row])


def test_find_smallest_returns_first_candidate(topology_ok):
  found = aot.find_smallest(_tiny(), families=("v5e",), log=lambda _: None)
  assert found["v5e"].topology == topology.CANDIDATES["v5e"][0]
  assert found["v5e"].rows[0].fits


def test_mesh_falls_back_to_fsdp_when_it_does_not_divide():
  assert aot.fitting_mesh(MeshConfig(1, -1, 8), 4) == MeshConfig(1, -1, 1)
  assert aot.fitting_mesh(MeshConfig(1, -1, 2), 4) == MeshConfig(1, -1, 2)


def test_unknown_topology_is_a_one_line_error(topology_ok):
  with pytest.raises(topology.AotError, match="invalid TPU topology 'v9z:2x2'"):
    topology.get_topology("v9z:2x2")
  with pytest.raises(topology.AotError, match="invalid TPU topology 'nonsense'"):
    topology.get_topology("nonsense")


def test_topology_leaves_no_tpu_environment_behind(topology_ok):
  """Processes started after an AOT compile (a training run) must not think they are on a TPU VM."""
  topology.get_topology("v5e:2x2")
  assert {k: os.environ.get(k) for k in _TPU_ENV} == _TPU_ENV


def test_missing_libtpu_is_a_one_line_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "libtpu", None)   # makes `import libtpu` raise ImportError
  monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
  with pytest.raises(topology.AotError, match=r'pip install "jax\[tpu\]==0\.12\.0\.1"'):
    topology.get_topology("v5e:2x2")


# -- the whole-run plan of a training config ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_preset():
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(presets.PRESETS, "aot-test-tiny", _TINY)
    yield


def _tiny_run(name="grpo_think", backend="model"):
  """The runlocal config on the tiny preset (simulator with 1 layer), short caches (which also keep
  the prefill chunk short: at most the cache length, bucketed); `_spec` reads it as the tool does."""
  config = _RUN_CONFIGS[name]("runlocal")
  config.policy.preset = "aot-test-tiny"
  config.simulator.preset = "aot-test-tiny:1"
  config.policy.max_context = 256
  config.simulator.max_context = 256
  config.simulator.backend = backend
  return config


_spec = aot_target.from_config


@pytest.fixture(scope="module")
def tiny_search(topology_ok, tiny_preset):
  """find_smallest over v5e for the tiny GRPO run: one compile of every program, shared by tests."""
  logs = []
  found = aot.find_smallest(_spec(_tiny_run()), families=("v5e",), log=logs.append)
  return found["v5e"], logs


def test_find_smallest_on_a_run_config_returns_first_candidate(tiny_search):
  found, logs = tiny_search
  assert found.topology == topology.CANDIDATES["v5e"][0]
  assert len(logs) == 1 and "run total" not in logs[0]   # streamed rows only, no header lines
  assert "| update phase: resident state + grpo_update | v5e:1x1 | 1x1x1 |" in logs[0]


def test_whole_run_table_has_every_program_and_the_run_total(tiny_search):
  found, _ = tiny_search
  programs = run_plan.run_programs(_spec(_tiny_run()))
  assert programs == ("policy_prefill", "policy_append", "policy_decode", "simulator_prefill",
                      "simulator_append", "simulator_decode", "grpo_update", "policy_reshard")
  assert tuple(r.program for r in found.rows) == programs
  for r in found.rows:
    assert r.fits and r.argument_bytes > 0 and r.temp_bytes >= 0 and r.total_bytes > r.argument_bytes
  ev = aot.Evaluation(found.topology, found.rows[0].mesh, found.rows, found.phases,
                      layouts=found.layouts)
  text = aot.format_evaluation(ev)
  for p in programs:
    assert f"| {p} | v5e:1x1 | 1x1x1 |" in text
  assert [p.name for p in found.phases] == ["rollout", "update"]
  assert all(p.fits and p.total_bytes > p.state_bytes > 0 for p in found.phases)
  peak = run_plan.run_total(found.phases)
  assert peak.total_bytes == max(p.total_bytes for p in found.phases)
  assert "| rollout phase: resident state + " in text
  assert "run total per device on v5e:1x1 (mesh 1x1x1): " in text and text.endswith(": fits")
  assert ("layouts: train 1x1x1, policy decode 1x1x1 (decode copy), simulator decode 1x1x1"
          in text)
  # The reshard runs beside the update's resident state, the decode copy in both phases.
  assert "update phase" in text and all("policy decode copy" in dict(p.state) for p in found.phases)


def test_run_program_arguments_match_the_resident_state(tiny_search):
  """Compiled argument sizes agree with the plan's abstract sizes (the plan counts them once)."""
  found, _ = tiny_search
  spec = _spec(_tiny_run())
  state = run_plan.Plan(spec, aot.run_layouts(spec, topology.get_topology("v5e:1x1")),
                        16 * 2**30).state
  rows = {r.program: r for r in found.rows}
  policy = state["rollout"]["policy decode copy"] + state["rollout"]["policy KV cache"]
  update = state["update"]["policy params"] + state["update"]["policy optimizer"]
  assert rows["policy_decode"].argument_bytes == pytest.approx(policy, rel=0.05)
  assert rows["grpo_update"].argument_bytes >= update
  assert rows["grpo_update"].alias_bytes == pytest.approx(update, rel=0.05)   # donated


def test_planned_cache_bytes_follow_the_rollout_rows(tiny_preset):
  """rollout.rows sizes both KV caches (continuous batching): 8 dialogues on 4 rows plan half the
  bytes of 8 rows (lockstep); the state the caches do not hold is unchanged."""
  config = _tiny_run()
  config.rl.profiles_per_step = 4  # 4 groups of 2
  devices = topology.get_topology("v5e:1x1")
  mesh = make_mesh(MeshConfig(), devices)
  plans = {}
  for rows in (0, 8, 4, 2):
    config.rollout.rows = rows
    spec = _spec(config)
    plans[rows] = run_plan.Plan(spec, aot.run_layouts(spec, devices), 16 * 2**30).state["rollout"]
    assert ap.rollout_rows(spec, mesh) == (rows or 8)
  c = _TINY
  # A simulator row (1 layer, fp32 as in runlocal): k and v of 256 slots, and its int32 length.
  sim_row = 2 * 1 * 256 * c.num_kv_heads * c.head_dim * 4 + 4
  policy_row = plans[2]["policy KV cache"] / 2
  for rows, state in plans.items():
    assert state["simulator KV cache"] == (rows or 8) * sim_row
    assert state["policy KV cache"] == (rows or 8) * policy_row
    assert state["policy params"] == plans[0]["policy params"]
  assert plans[8] == plans[0]


def test_resident_state_counts_per_device_shards(tiny_preset):
  config = _tiny_run("ppo_think")
  config.simulator.mesh = config.rollout.policy_mesh = "train"   # every model FSDP over 4
  spec = _spec(config)
  devices = topology.get_topology("v5e:2x2")
  mesh = make_mesh(MeshConfig(), devices)
  state = run_plan.Plan(spec, aot.run_layouts(spec, devices), 16 * 2**30).state
  rollout, update = state["rollout"], state["update"]
  assert set(rollout) - set(update) == {"policy KV cache"}
  assert set(update) == {"policy params", "policy optimizer", "critic params", "critic optimizer",
                         "simulator params", "simulator KV cache"}
  # AdamW keeps two fp32 moments per param (plus scalar counts).
  assert 0 <= update["policy optimizer"] - 2 * update["policy params"] < 1024
  # k and v in the simulator's dtype (fp32 in runlocal), 1 layer; PPO runlocal has 2 dialogues,
  # padded to 4 cache rows like the rollout's (4 fsdp devices could not split 2): one row per
  # device, and its length (unpadded, every device held both rows).
  c = _TINY
  assert ap.num_dialogues(spec) == 2 and ap.rollout_rows(spec, mesh) == 4
  assert spec.simulator.dtype == "float32"
  assert update["simulator KV cache"] == 2 * 1 * 1 * 256 * c.num_kv_heads * c.head_dim * 4 + 1 * 4
  # The update's micro-batch has micro_batch_size (2) rows per batch shard, but no more than a
  # mini-batch needs: its 2 rows (2 dialogues, 2 turns: mini-batches of 2 rows) take one row on
  # each of the 4 fsdp devices, not 2 x 4.
  batch = ap.abstract_batch(spec, mesh).tokens
  assert ap.mini_batches(spec) == 2
  assert batch.shape == (1, 4, 256) and batch.sharding.shard_shape(batch.shape) == (1, 1, 256)


def test_sampler_programs_compile_the_tpu_cache_layout(tiny_preset):
  """The plan compiles for TPU from a CPU process: its caches take the TPU layout, not the host's."""
  mesh = make_mesh(MeshConfig(), topology.get_topology("v5e:1x1"))
  _, args = ap.PROGRAMS["simulator_decode"](_spec(_tiny_run()), mesh)
  caches = [a for a in args if isinstance(a, KVCache)]
  assert len(caches) == 1 and caches[0].layout == "slots_major" == default_layout("tpu")
  c = _TINY
  assert caches[0].k.shape == (1, 2, 256, c.num_kv_heads, c.head_dim)  # [L, B, S, K, Dh]
  assert jax.default_backend() == "cpu" and default_layout() == "heads_major"


def test_run_programs_and_update_shapes():
  grpo, ppo, nothink = (_spec(_RUN_CONFIGS[n]()) for n in ("grpo_think", "ppo_think", "grpo_nothink"))
  # A serving layout for the policy ('auto') adds the reshard of its decode copy after the update.
  assert run_plan.update_programs(ppo) == ("ppo_policy_update", "ppo_critic_update", "policy_reshard")
  http = _RUN_CONFIGS["ppo_think"]()
  with http.unlocked():  # a server the plan never calls (the run spec requires one for http)
    http.simulator.backend = "http"
    http.simulator.http_base_url, http.simulator.http_model = "http://127.0.0.1:9/v1", "m"
    http.rollout.policy_mesh = "train"   # decode from the training params: no copy, no reshard
  assert run_plan.run_programs(_spec(http)) == ("policy_prefill", "policy_append", "policy_decode",
                                       "ppo_policy_update", "ppo_critic_update")
  # Think mode drops thoughts, so every turn is a sample: 32 profiles x 4 x 9 turns = 1152 rows in
  # mini-batches of 128 rows (9 updates), each 32 micro-batches of 4; no-think: 128 rows, one update.
  assert ap.mini_batches(grpo) == 9 and ap.mini_batches(nothink) == 1
  assert ap.micro_batches(grpo) == 32 and ap.micro_batches(nothink) == 32
  assert ap.mini_batches(ppo) == 9 and ap.micro_batches(ppo) == 8  # 32 x 9 rows, 32 a mini-batch
  assert {"old_values", "returns"} <= set(ap.batch_keys(ppo)) and "returns" not in ap.batch_keys(grpo)
  assert (grpo.policy.preset, grpo.simulator.preset) == ("qwen2.5-7b", "qwen2.5-72b")


def test_preset_with_a_layer_count():
  c = model_config(ModelShape("qwen2.5-0.5b:2"))
  assert c.num_layers == 2 and c.hidden_size == presets.PRESETS["qwen2.5-0.5b"].hidden_size
  assert model_config(ModelShape("qwen2.5-0.5b", num_layers=3)).num_layers == 3


def test_programs_filter_rejects_unknown_names():
  with pytest.raises(topology.AotError, match="'forward' is not one of this config's"):
    aot.program_names(_spec(_RUN_CONFIGS["grpo_think"]()), ["forward"])
  assert aot.program_names(_tiny(), ["forward"]) == ("forward",)


def test_update_plan_uses_the_trainers_padded_shapes():
  # pack pads the packed rows and length up to shape buckets; the plan must compile the same.
  import numpy as np
  from types import SimpleNamespace
  from rlver_jax.rl.pack import pack
  from rlver_jax.env.rollout import Sample
  config = _RUN_CONFIGS["grpo_nothink"]()
  with config.unlocked():
    config.policy.max_context = 10000
    config.rl.profiles_per_step = 40  # 160 dialogues: 40 micro-batches of 4 before padding
  config = _spec(config)
  micro, mini = ap.micro_batch_rows(config), ap.mini_batches(config)
  samples = [Sample(0, [1] * config.policy.max_context, [1] * config.policy.max_context,
                    [0.0] * config.policy.max_context, [0])] * ap.num_samples(config)
  packed = pack([SimpleNamespace(samples=samples)], micro, pad_id=0, mini_batches=mini,
                      mini_batch_rows=160).tokens.shape
  # 160 rows in one mini-batch (-1: profiles_per_step x group_size).
  assert mini == 1
  assert packed == (ap.micro_batches(config) * micro, ap.packed_length(config)) == (192, 12288)


def test_bad_config_values_are_one_line_errors():
  """The tool reads a config as the trainer does (its RunSpec): a value training would refuse is
  refused before any compile (a zero micro-batch was a ZeroDivisionError), naming the key."""
  config = _RUN_CONFIGS["grpo_think"]()
  with config.unlocked():
    config.rl.micro_batch_size = 0
  with pytest.raises(ValueError, match=r"config\.rl\.micro_batch_size=0"):
    _spec(config)
  forward = _GET_CONFIG("tiny")
  with forward.unlocked():
    forward.forward.seq_len = 0
  with pytest.raises(ValueError, match=r"config\.forward\.seq_len=0: must be an integer >= 1"):
    _spec(forward)
  with forward.unlocked():
    forward.forward.seq_len, forward.model.colour = 8, "red"
  with pytest.raises(ValueError, match="aot config: .*colour"):
    _spec(forward)
