"""The package's shape holds: docs/ARCHITECTURE.md's Layout block names every module, and every
folder imports only what its `__init__.py` says it may (the rule that keeps `env/` and `rl/`
independent and the model free of sampling and dialogues)."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rlver_jax"
# Transcribed from each folder's __init__.py docstring ("May import: ..."); a change there is a
# change here. Top-level modules are the build step and the entry points (main, evaluate, ...).
MAY_IMPORT = {
    "spec": {"env", "rl", "sampling", "models", "parallel"},
    "train": {"models", "sampling", "env", "rl", "run", "parallel", "evaluation", "build", "spec"},
    "evaluation": {"models", "sampling", "env", "run", "parallel", "build", "spec"},
    "aot": {"models", "sampling", "rl", "parallel", "cli", "build", "spec"},
    "run": {"models", "parallel", "spec", "env", "build"},
    "env": {"models", "sampling", "parallel"},
    "rl": {"models", "parallel"},
    "sampling": {"models", "parallel"},
    "models": {"parallel"},
    "parallel": set(),
    "cli": set(),
    "build": {"spec", "env", "rl", "sampling", "models", "parallel", "run", "cli"},
}
ONLY_FROM = {("run", "build"): {"trained_policy"}}  # run/ rebuilds a saved policy there alone


def _targets(tree: ast.AST):
  """(line, the rlver_jax folder or top-level module each import names)."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = ([f"rlver_jax.{a.name}" for a in node.names] if node.module == "rlver_jax"
               else [node.module])
    else:
      continue
    for name in names:
      parts = name.split(".")
      if parts[0] == "rlver_jax" and len(parts) > 1:
        yield node.lineno, parts[1]


def _files(folder: str):
  return sorted(PACKAGE.glob(f"{folder}.py")) or sorted((PACKAGE / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_imports_point_down(folder):
  wrong = []
  for path in _files(folder):
    for line, target in _targets(ast.parse(path.read_text(), str(path))):
      allowed = target == folder or (target in MAY_IMPORT[folder]
                                     and path.stem in ONLY_FROM.get((folder, target), {path.stem}))
      if not allowed:
        wrong.append(f"{path.relative_to(ROOT)}:{line} imports rlver_jax.{target}")
  assert not wrong, "\n".join(wrong)


def test_every_folder_is_ruled():
  folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
  assert folders <= set(MAY_IMPORT), f"no import rule for {sorted(folders - set(MAY_IMPORT))}"


def test_architecture_layout_names_every_module():
  text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
  block = text[text.index("## Layout"):text.index("## What is where")]
  missing = [f"{p.parent.name}/{p.stem}" for folder in MAY_IMPORT if (PACKAGE / folder).is_dir()
             for p in sorted((PACKAGE / folder).glob("*.py"))
             if p.stem not in ("__init__", "__main__") and not re.search(rf"\b{p.stem}\b", block)]
  assert not missing, f"docs/ARCHITECTURE.md's Layout block does not name {missing}"


def test_only_the_entry_points_read_a_config_dict():
  # Below the command lines every setting is typed (rlver_jax/spec/): nothing else imports
  # ml_collections. The entry points and cli/ parse --config into a ConfigDict and hand its data on.
  entry = {"main.py", "evaluate.py", "evaluate_general.py", "generate.py", "export.py"}
  readers = []
  for path in sorted(PACKAGE.rglob("*.py")):
    rel = path.relative_to(PACKAGE)
    if str(rel) in entry or rel.parts[0] == "cli" or rel == pathlib.Path("aot/cli.py"):
      continue
    names = {n.module if isinstance(n, ast.ImportFrom) else a.name
             for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in (n.names if isinstance(n, ast.Import) else [None])}
    if any(name and name.split(".")[0] == "ml_collections" for name in names):
      readers.append(str(rel))
  assert not readers, f"modules below the entry points import ml_collections: {readers}"
