"""Loads a task's JSONL files named relative to this folder (lm-eval's `custom_dataset` hook).

`datasets.load_dataset("json", data_files=...)` resolves a relative path against the working
directory, so a task that ships beside its data would only work from one folder; this resolves it
against the task's own folder and otherwise reads the files exactly the same way.
"""
import os

import datasets

_HERE = os.path.dirname(os.path.abspath(__file__))


def load(data_files=None, **_):
  """`data_files` as in the YAML's dataset_kwargs ({split: file}); the task's metadata is ignored."""
  if not data_files:
    raise ValueError("a local task needs dataset_kwargs.data_files ({split: file.jsonl})")
  files = {split: os.path.join(_HERE, f) for split, f in data_files.items()}
  for split, path in files.items():
    if not os.path.isfile(path):
      raise FileNotFoundError(f"data file of split {split!r} not found: {path}")
  return datasets.load_dataset("json", data_files=files)
