"""Every `python -m rlver_jax.X ...` command that README.md and the docs show parses: the module
exists, each `--flag` is an absl flag of that entry point, each `--config=FILE[:ARGS]` file exists
and its get_config accepts the arguments, and each `--config.KEY=VALUE` names a key of the resolved
config. Values are not checked (they are placeholders such as HF_DIR or gs://B/...), only names.

Nothing is run. The entry points' flags are read from absl's registry after importing each entry
module; two entry points define the same flag names (`--config`, `--workdir`), which absl refuses in
one process, so one child process imports them in turn and lists each one's flags.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in REPO.glob("docs/*.md")),
        *sorted(str(p.relative_to(REPO)) for p in REPO.glob("*/README.md"))]
FALLBACK_CONFIG = {"rlver_jax.evaluate": "configs/eval_sentient.py"}
ABSL_SPECIAL = {"help", "helpshort", "helpfull", "helpxml", "flagfile", "undefok"}  # parser's own
CLOSER = {'"': '"', "'": "'", "(": ")"}
COMMAND = re.compile(r"python -m (rlver_jax[\w.]*)")

# Imports each entry module given on argv, records the flags it added (name -> is boolean), then
# removes those flags and every rlver_jax module again, so the next one defines its own afresh.
_LIST_FLAGS = r"""
import importlib, json, sys
from absl import app, flags, logging  # their own flags (--verbosity, ...) stay defined throughout
FLAGS = flags.FLAGS
out = {}
for name in sys.argv[1:]:
  before = set(FLAGS)
  importlib.import_module(name)
  out[name] = {f: isinstance(FLAGS[f], flags.BooleanFlag) for f in FLAGS}
  for f in set(FLAGS) - before:
    delattr(FLAGS, f)
  for m in [m for m in sys.modules if m == "rlver_jax" or m.startswith("rlver_jax.")]:
    del sys.modules[m]
print(json.dumps(out))
"""


def _code(text: str) -> list[str]:
  """Fenced blocks, indented blocks and inline code spans of a Markdown text."""
  pieces, prose = [], []
  for i, part in enumerate(re.split(r"^```[^\n]*\n", text, flags=re.M)):
    (pieces if i % 2 else prose).append(part)
  for part in prose:
    pieces += re.findall(r"`([^`]+)`", part)
    pieces += re.findall(r"^    (\S.*)$", part, flags=re.M)
  return pieces


def documented_commands(text: str) -> list[list[str]]:
  """Each command's words from `python -m` on, continuation lines joined, comments dropped."""
  commands = []
  for piece in _code(text):
    for line in piece.replace("\\\n", " ").replace("\n", " \n").splitlines():
      for m in COMMAND.finditer(line):
        rest = re.split(r"\s(?:&&|;|\|)\s", line[m.end():])[0]  # a shell list's next command
        opener = line[m.start() - 1] if m.start() else ""
        if opener in CLOSER:  # E="python -m ... $SIM": the command ends with the quote
          rest = rest.split(CLOSER[opener])[0]
        commands.append([m.group(1).rstrip("."), *shlex.split(rest, comments=True)])
  return commands


def _all_commands() -> list[tuple[str, list[str]]]:
  return [(doc, words) for doc in DOCS for words in documented_commands((REPO / doc).read_text())]


def _entry(module: str) -> str:
  """The module `python -m` runs: a package's __main__."""
  spec = importlib.util.find_spec(module)
  assert spec is not None, f"no module {module}"
  return f"{module}.__main__" if spec.submodule_search_locations else module


@functools.lru_cache(maxsize=None)
def _flags(entries: tuple[str, ...]) -> dict[str, dict[str, bool]]:
  path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
  r = subprocess.run([sys.executable, "-c", _LIST_FLAGS, *entries], capture_output=True, text=True,
                     cwd=REPO, env=env, timeout=600, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=None)
def _config(path: str, arg: str | None):
  name = f"documented_{pathlib.Path(path).stem}"
  spec = importlib.util.spec_from_file_location(name, REPO / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg is not None else module.get_config()


def _has_key(config, key: str) -> bool:
  node = config
  for part in key.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      return False
    node = node[part]
  return True


def problems(module: str, args: list[str], known: dict[str, bool]) -> list[str]:
  """What is wrong with one command's names, given its entry point's flags (name -> is boolean)."""
  wrong, config = [], None
  for word in args:
    if word == "--":
      break  # what follows goes to another program
    if not word.startswith("--") or word.startswith("$"):
      continue  # a value, `...`, or a shell variable holding more flags
    name, eq, value = word[2:].partition("=")
    if name.startswith("config.") or name == "config":
      if "config" not in known:
        wrong.append(f"--{name}: {module} has no --config")
        continue
      if name == "config":
        if value.startswith("$"):
          continue
        path, sep, arg = value.partition(":")
        if not (REPO / path).is_file():
          wrong.append(f"--config={value}: no file {path}")
          continue
        try:
          config = _config(path, arg if sep else None)
        except Exception as e:  # noqa: BLE001  (the config's own message names the argument)
          wrong.append(f"--config={value}: {type(e).__name__}: {e}")
      elif config is not None and not _has_key(config, name[len("config."):]):
        wrong.append(f"--{name}: no such key in the resolved config")
      continue
    if name in known or name in ABSL_SPECIAL:
      continue
    if not eq and name.startswith("no") and known.get(name[2:]):
      continue  # --noFLAG of a boolean flag
    wrong.append(f"--{name}: not a flag of python -m {module}")
  if config is None and any(w.startswith("--config.") for w in args):
    # overrides with no config file in the command (a shell variable holds it): the keys must
    # still exist in the entry point's usual config
    base = _config(FALLBACK_CONFIG.get(module, "configs/grpo_think.py"), None)
    wrong += [f"{w.split('=')[0]}: no such key" for w in args if w.startswith("--config.")
              and not _has_key(base, w.split("=")[0][len("--config."):])]
  return wrong


def test_benchmarks_readme_lists_every_script():
  text = (REPO / "benchmarks" / "README.md").read_text()
  bench = REPO / "benchmarks"
  missing = [p.name for p in sorted(bench.glob("*.py")) + sorted(bench.glob("*.sh"))
             if f"`{p.name}`" not in text]
  assert not missing, f"benchmarks/README.md does not list {missing}"


def test_documents_show_commands():
  commands = _all_commands()
  docs = {doc for doc, _ in commands}
  assert "README.md" in docs and len(commands) >= 10, commands


def test_every_documented_command_parses():
  commands = _all_commands()
  modules = sorted({words[0] for _, words in commands})
  entries = {m: _entry(m) for m in modules}
  known = _flags(tuple(sorted(set(entries.values()))))
  wrong = [f"{doc}: python -m {' '.join(words)}\n    {p}" for doc, words in commands
           for p in problems(words[0], words[1:], known[entries[words[0]]])]
  assert not wrong, "\n".join(wrong)


def test_a_typo_is_caught():
  """The checks fail on a mistyped flag, config key, config argument and config file."""
  known = _flags(("rlver_jax.main",))["rlver_jax.main"]
  good = ["--config=configs/grpo_think.py:runlocal", "--workdir=/tmp/x", "--config.rl.group_size=4",
          "--verbosity=1"]
  assert problems("rlver_jax.main", good, known) == []
  for typo in ["--workdri=/tmp/x", "--config.rl.groupsize=4", "--config.rll.group_size=4"]:
    assert problems("rlver_jax.main", [good[0], typo], known), typo
  for typo in ["--config=configs/grpo_think.py:runloca", "--config=configs/grpo_thinks.py"]:
    assert problems("rlver_jax.main", [typo], known), typo
  text = ("```\npython -m rlver_jax.main --config=configs/demo.py \\\n"
          "    --config.rl.group_sise=2  # x\n```\n")
  [words] = documented_commands(text)
  assert problems(words[0], words[1:], known) == [
      "--config.rl.group_sise: no such key in the resolved config"]


@pytest.mark.parametrize("text,expected", [
    ("`python -m rlver_jax.export --workdir=runs/RUN --out=/tmp/x`",
     [["rlver_jax.export", "--workdir=runs/RUN", "--out=/tmp/x"]]),
    ('E="python -m rlver_jax.evaluate --config.policy.top_k=20 $SIM"\n',
     []),  # prose, not code: ignored
    ('```\nE="python -m rlver_jax.evaluate --config.policy.top_k=20 $SIM"\n```\n',
     [["rlver_jax.evaluate", "--config.policy.top_k=20", "$SIM"]]),
    ("    python -m rlver_jax.aot --estimate_time && echo done\n",
     [["rlver_jax.aot", "--estimate_time"]]),
])
def test_extraction(text, expected):
  assert documented_commands(text) == expected
