"""python -m rlver_jax.evaluate_general: a local task end to end on the embedded model (results JSON
and table agree with the samples), before/after a tiny training run, and one clear line for bad
flags, unknown tasks and task data that cannot be reached."""
import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("lm_eval", reason="needs lm-eval==0.4.13 (pip install -e '.[eval]')")

import tiny_world  # noqa: E402
from rlver_jax.cli import errors as cli_errors  # noqa: E402
from rlver_jax.evaluation import general as general_eval  # noqa: E402
from rlver_jax.train import loop as train  # noqa: E402
from rlver_jax.spec import RunSpec  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]


def _cli(*args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(REPO),
             HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
  return subprocess.run([sys.executable, "-m", "rlver_jax.evaluate_general", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=timeout)


def _last_line(proc) -> str:
  return proc.stderr.strip().splitlines()[-1]


def test_cli_runs_local_tasks_on_the_embedded_model(tmp_path):
  out = tmp_path / "general.json"
  proc = _cli("--checkpoint=embedded", "--tasks=rlver_tiny_mc,rlver_tiny_gen", "--limit=3",
              f"--out={out}", "--max_length=256", "--batch_size=3", "--bootstrap_iters=0",
              "--log_samples")
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(out.read_text())
  assert results["rlver_jax"]["flags"]["tasks"] == ["rlver_tiny_mc", "rlver_tiny_gen"]
  mc = results["samples"]["rlver_tiny_mc"]
  assert len(mc) == 3 and "<|im_start|>" in mc[0]["arguments"][0][0]  # templated
  acc = np.mean([np.argmax([r[0][0] for r in s["resps"]]) == s["target"] for s in mc])
  assert results["results"]["rlver_tiny_mc"]["acc,none"] == pytest.approx(acc)
  gen = results["samples"]["rlver_tiny_gen"]
  first = [re.match(r"\W*(\w+)", s["resps"][0][0]) for s in gen]
  match = np.mean([bool(m) and m.group(1).lower() == s["target"].lower() for m, s in zip(first, gen)])
  assert results["results"]["rlver_tiny_gen"]["exact_match,first_word"] == pytest.approx(match)
  table = (tmp_path / "general.md").read_text()
  assert table == general_eval.summary_table(results) + "\n"
  assert f"| rlver_tiny_mc | acc | none | {acc:.4f} | - | 3 |" in table
  assert table in proc.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 1-step GRPO run on the tiny world (checkpoint at step 1)."""
  root = tmp_path_factory.mktemp("general")
  world = tiny_world.make_world(root / "world")
  config = tiny_world.training_config(world, "grpo", **{"total_steps": 1, "checkpoint.every_steps": 1})
  train.run(RunSpec.from_config(config), str(root / "run"))
  return {"world": world, "workdir": str(root / "run")}


def _lls(results) -> np.ndarray:
  samples = sorted(results["samples"]["rlver_tiny_mc"], key=lambda s: s["doc_id"])
  return np.array([[r[0][0] for r in s["resps"]] for s in samples])


def test_before_after_of_a_training_run(run, tmp_path):
  out = tmp_path / "general.json"
  proc = _cli(f"--workdir={run['workdir']}", "--compare_base", "--tasks=rlver_tiny_mc", "--limit=3",
              "--noapply_chat_template", "--max_length=64", "--batch_size=2", "--bootstrap_iters=0",
              "--log_samples", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  after = json.loads(out.read_text())
  before = json.loads((tmp_path / "general.base.json").read_text())
  assert after["rlver_jax"]["evaluated"] == f"{run['workdir']} step 1"
  assert before["rlver_jax"]["evaluated"] == f"{run['world']['policy']} (base of {run['workdir']})"
  # The base is the run's starting checkpoint, evaluated here directly; training moved the policy.
  lm, _ = general_eval.load_lm(checkpoint=run["world"]["policy"], batch_size=2, max_length=64)
  direct = general_eval.evaluate(lm, ["rlver_tiny_mc"], limit=3, apply_chat_template=False,
                                 log_samples=True, bootstrap_iters=0)
  np.testing.assert_allclose(_lls(before), _lls(direct), rtol=1e-6)
  assert np.abs(_lls(after) - _lls(before)).max() > 1e-4  # one step at lr 3e-2
  rows = general_eval.compare_rows(before, after)
  assert [(r["task"], r["metric"]) for r in rows] == [("rlver_tiny_mc", "acc"), ("rlver_tiny_mc", "acc_norm")]
  for r in rows:
    key = f"{r['metric']},none"
    assert r["before"] == before["results"]["rlver_tiny_mc"][key]
    assert r["after"] == after["results"]["rlver_tiny_mc"][key]
    assert r["change"] == pytest.approx(r["after"] - r["before"])
  table = (tmp_path / "general.md").read_text()
  assert table == general_eval.compare_table(before, after) + "\n" and table in proc.stdout
  lines = table.splitlines()
  assert lines[0] == "| task | metric | filter | before | after | change | samples |"
  r = rows[0]
  assert lines[2] == (f"| rlver_tiny_mc | acc | none | {r['before']:.4f} | {r['after']:.4f} | "
                      f"{r['change']:+.4f} | 3 |")


def test_unknown_task_and_unreachable_data_are_one_line_errors(tmp_path):
  tasks = tmp_path / "tasks"
  tasks.mkdir()
  missing = tmp_path / "nowhere" / "data.jsonl"
  (tasks / "broken.yaml").write_text(
      "task: broken_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
      f"    test: {missing}\noutput_type: generate_until\ntest_split: test\n"
      "doc_to_text: q\ndoc_to_target: a\nmetric_list:\n  - metric: exact_match\n")
  with pytest.raises(general_eval.TaskError, match="unknown task 'no_such_task'"):
    general_eval.load_tasks(["no_such_task"], str(tasks))
  with pytest.raises(general_eval.TaskError, match="no such directory"):
    general_eval.load_tasks(["rlver_tiny_mc"], str(tmp_path / "absent"))
  # The CLI prints a TaskError as its one line (raised here, not inside a library: no traceback);
  # it is raised while the tasks load, before any model.
  with pytest.raises(general_eval.TaskError) as e:
    general_eval.load_tasks(["rlver_tiny_mc", "broken_local"], str(tasks))
  assert str(e.value).startswith("--tasks: the data of task 'broken_local' cannot be reached ("), e.value
  assert str(missing) in str(e.value) and "\n" not in str(e.value)
  assert cli_errors.raised_here(e.value)


@pytest.mark.parametrize("args, message", [
    (["--checkpoint=embedded", "--workdir=/tmp"], "give exactly one of --checkpoint and --workdir"),
    (["--checkpoint=embedded", "--compare_base"], "--compare_base needs --workdir"),
    (["--checkpoint=embedded", "--out=/no/such/dir/r.json"], "does not exist or is not writable"),
    (["--checkpoint=embedded", "--out=results.txt"], "must be a .json file path"),
    (["--workdir=/no/such/run"], "--workdir=/no/such/run: no such directory"),
])
def test_bad_flags_fail_before_loading(args, message, tmp_path):
  if not any(a.startswith("--out") for a in args):
    args = args + [f"--out={tmp_path / 'r.json'}"]
  proc = _cli("--tasks=rlver_tiny_mc", *args, timeout=120)
  assert proc.returncode == 1 and message in _last_line(proc), proc.stderr[-2000:]


def test_sharded_backend_equals_one_device(tmp_path):
  """On conftest's 8 fake CPU devices (data 2 x fsdp 2 x tensor 2) the scoring program gives what one
  device gives: the batch (rounded up to the 4 batch shards) and the params are split over the mesh.
  (Generation runs on the sampler, whose sharded programs its own tests cover.)"""
  import jax
  import jax.numpy as jnp
  from lm_eval.api.instance import Instance

  from rlver_jax.evaluation.lm_eval_backend import RlverLM
  from rlver_jax.models import load_pretrained
  from rlver_jax.models.tokenizer import load_tokenizer
  from rlver_jax.parallel.sharding import MeshConfig, make_mesh

  if len(jax.devices()) < 8:
    pytest.skip("needs 8 (fake) devices")
  world = tiny_world.make_world(tmp_path / "world")
  path = world["policy"]
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  lms = []
  for m in (None, mesh):
    with jax.set_mesh(m) if m is not None else contextlib.nullcontext():
      model, _ = load_pretrained(path, dtype=jnp.float32, mesh=m)
    lms.append(RlverLM(model, load_tokenizer(path), batch_size=3, max_length=32, mesh=m))
  assert lms[1].batch_size == 4
  assert len(lms[1].params["embed"][...].sharding.device_set) > 1
  ll = [Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in enumerate([
      ("hello you", " are fine"), ("we try", " a step"), ("", "the plan is good"),
      ("so what", " no"), ("why not", " yes maybe"), ("it is", " okay")])]
  one, sharded = (lm.loglikelihood(ll) for lm in lms)
  np.testing.assert_allclose([x[0] for x in sharded], [x[0] for x in one], rtol=1e-5, atol=1e-5)
  assert [x[1] for x in sharded] == [x[1] for x in one]
