"""Entry points: a problem we named is one line; a ValueError raised inside a library keeps its traceback."""
import json

import ml_collections
import pytest

from rlver_jax.cli_errors import exit_on, raised_here
from rlver_jax.run_config import ConfigConflictError, check_workdir_config


def _ours(tmp_path):
  (tmp_path / "config.json").write_text("[1]")
  with pytest.raises(ConfigConflictError) as e:
    check_workdir_config(ml_collections.ConfigDict({"a": 1}), str(tmp_path))
  return e.value


def _library():
  with pytest.raises(ValueError) as e:
    json.loads("{")  # raised in the json package's Python code
  return e.value


def test_our_errors_are_told_apart_from_a_librarys(tmp_path):
  assert raised_here(_ours(tmp_path))
  assert not raised_here(_library())


def test_exit_on_prints_a_traceback_only_for_a_library_error(tmp_path, capsys):
  with pytest.raises(SystemExit) as out:
    exit_on(_library())
  assert str(out.value.code).startswith("error: Expecting property name")
  assert "Traceback" in capsys.readouterr().err
  with pytest.raises(SystemExit) as out:
    exit_on(_ours(tmp_path), prefix="aot: error")
  assert str(out.value.code).startswith("aot: error: ") and "config.json" in str(out.value.code)
  assert "Traceback" not in capsys.readouterr().err
