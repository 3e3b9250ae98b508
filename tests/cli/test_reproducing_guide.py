"""docs/REPRODUCING.md's mechanics table matches the code: every key it names exists, its default and
`:reference` columns are the resolved configs' values, and it lists every key `:reference` sets."""
import ast
import importlib.util
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _config(name, arg=None):
  spec = importlib.util.spec_from_file_location(f"guide_{name}", REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg), module


def _rows():
  text = (REPO / "docs" / "REPRODUCING.md").read_text()
  rows = []
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 6 and cells[4].startswith("`"):
      rows.append((cells[4].strip("`"), cells[2], cells[3]))
  return rows


def _value(cell, think):
  """A table cell's value: `V`, or `think: `V1`, no-think: `V2`` for a value per think mode."""
  per_mode = dict(re.findall(r"(no-think|think): `([^`]*)`", cell))
  return ast.literal_eval(per_mode["think" if think else "no-think"] if per_mode else cell.strip("`"))


def _get(config, key):
  node = config
  for part in key.split("."):
    node = node[part]
  return node


@pytest.mark.parametrize("name", ["grpo_think", "ppo_think", "grpo_nothink", "ppo_nothink"])
def test_table_matches_the_resolved_configs(name):
  rows = _rows()
  assert len(rows) >= 18
  plain, module = _config(name)
  reference, _ = _config(name, "reference")
  think = plain.policy.think
  for key, default, ref in rows:
    assert _get(plain, key) == _value(default, think), key
    assert _get(reference, key) == _value(ref, think), key
  keys = {key for key, _, _ in rows}
  set_by_reference = set(module.base.REFERENCE_VALUES)
  if think:
    set_by_reference |= set(module.base.REFERENCE_THINK_VALUES)
  assert set_by_reference <= keys
  # Every key where :reference and the plain config differ is a row of the table.
  flat = lambda c: {f"{s}.{k}": v for s, d in c.to_dict().items() if isinstance(d, dict)
                    for k, v in d.items()}
  differ = {k for k, v in flat(reference).items() if flat(plain)[k] != v}
  assert differ <= keys and differ == set_by_reference


def test_every_item_of_the_reference_comparison_has_a_row():
  # The mechanics the released code and SAGE were compared on, each with its key in the table.
  keys = {key for key, _, _ in _rows()}
  assert {"simulator.state_change_range", "rl.format_penalty", "simulator.end_above",
          "rl.group_stats", "simulator.goodbye_match", "data.sampling",
          "simulator.history_chars", "policy.prompt", "eval.policy_prompt",
          "eval.policy_max_new_tokens", "eval.info_flow"} <= keys


def test_reference_combines_with_runlocal_and_simulator_style():
  both, _ = _config("grpo_think", "reference,runlocal,simulator=challenging")
  assert both.simulator.style == "challenging" and both.policy.checkpoint == "embedded"
  assert both.policy.max_new_tokens == 32  # runlocal's sizes win
  assert both.simulator.clamp_change is False and both.optim.warmup_unit == "steps"
  with pytest.raises(ValueError, match="unknown config argument"):
    _config("grpo_think", "referense")


def test_readme_links_the_guide():
  assert "docs/REPRODUCING.md" in (REPO / "README.md").read_text()
