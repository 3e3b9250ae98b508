"""Every setting has one default: the spec's dataclasses declare it, and a config file assigns a key
only to change it. A config line that restates a default (a second declaration that could drift
from the first) fails here, as does a config whose key set differs from the spec's."""
import ast
import importlib.util
import pathlib

import pytest

from rlver_jax.spec import EvaluationSpec, RunSpec, default_tree

REPO = pathlib.Path(__file__).resolve().parents[2]
TRAINING = ["grpo_think", "grpo_nothink", "ppo_think", "ppo_nothink"]


def _config(name, arg=None):
  module_spec = importlib.util.spec_from_file_location(f"one_default_{name}",
                                                       REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg).to_dict()


def _flat(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
  return out


def _assigned(path: pathlib.Path, function: str) -> set[str]:
  """The dotted keys `c.a.b = ...` assigned in `function`'s own body (not its helpers)."""
  tree = ast.parse(path.read_text())
  body = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
  keys = set()
  for node in ast.walk(body):
    if isinstance(node, ast.Assign):
      for target in node.targets:
        parts = []
        while isinstance(target, ast.Attribute):
          parts.append(target.attr)
          target = target.value
        if isinstance(target, ast.Name) and target.id == "c" and parts:
          keys.add(".".join(reversed(parts)))
  return keys


def _changed(trees, defaults) -> set[str]:
  return {k for tree in trees for k, v in _flat(tree).items() if v != defaults[k]}


def test_the_training_configs_assign_only_what_differs_from_the_spec():
  defaults = _flat(default_tree(RunSpec))
  trees = [_config(name, arg) for name in TRAINING for arg in (None, "simulator=challenging")]
  assert all(set(_flat(t)) == set(defaults) for t in trees)  # the spec's keys, no more, no fewer
  assigned = _assigned(REPO / "configs" / "base.py", "get_base_config")
  # Each key the config assigns changes it in some config; no other key differs from the default.
  assert _changed(trees, defaults) == assigned
  assert len(assigned) <= 12


def test_the_evaluation_config_assigns_only_what_differs_from_the_spec():
  defaults = _flat(default_tree(EvaluationSpec))
  trees = [_config("eval_sentient", arg) for arg in (None, "think=false", "simulator=challenging")]
  assert all(set(_flat(t)) == set(defaults) for t in trees)
  assert _changed(trees, defaults) == _assigned(REPO / "configs" / "eval_sentient.py", "get_config")


def test_the_config_files_stay_small():
  # The paper's values, per algorithm and mode, :reference and :runlocal; defaults live in the spec.
  text = (REPO / "configs" / "base.py").read_text()
  tree = ast.parse(text)
  values = sum(isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Attribute)
               for n in ast.walk(tree))
  reference = next(n for n in tree.body if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", "") == "REFERENCE_VALUES")
  values += len(reference.value.keys)
  assert values <= 60


@pytest.mark.parametrize("cls,kind", [(RunSpec, "training"), (EvaluationSpec, "evaluation")])
def test_a_config_says_what_it_is(cls, kind):
  tree = default_tree(cls)
  assert tree["kind"] == kind and cls.from_config(tree).kind == kind
  other = EvaluationSpec if cls is RunSpec else RunSpec
  with pytest.raises(ValueError, match=rf"config\.kind='{kind}': this is a '{other.KIND}' setting"):
    other.from_config({"kind": kind})
