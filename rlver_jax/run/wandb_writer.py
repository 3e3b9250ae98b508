"""Optional Weights & Biases logging (config.log.wandb_project): what MetricsWriter writes to
metrics.jsonl and TensorBoard, the resolved config, the reward plot and transcripts as tables.

Process 0 only (MetricsWriter calls it from its process-0 writes). The W&B run id is kept in
WORKDIR/wandb_run_id, so a resumed workdir continues the same W&B run. Every row carries the
training `step` as its x-axis (define_metric), not W&B's own `_step`: a resumed run redoes the
steps after its checkpoint, and W&B drops a `step=` lower than one it has seen.

A bad setting fails the start with one line; a W&B failure later warns once and turns W&B off
for the rest of the run, since logging must not end a multi-hour run (metrics.jsonl and
TensorBoard still hold everything)."""
from __future__ import annotations

import dataclasses
import io
import secrets
from typing import Any

from absl import logging
from etils import epath

RUN_ID_FILE = "wandb_run_id"


class WandbStartError(ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class WandbOptions:
  project: str
  entity: str = ""      # '' = the API key's default entity
  run_name: str = ""    # '' = W&B's generated name
  config: dict = dataclasses.field(default_factory=dict)  # as in WORKDIR/config.json


def import_wandb():
  try:
    import wandb
  except ImportError:
    raise ImportError("config.log.wandb_project is set but wandb is not installed: "
                      "pip install 'rlver_jax[wandb]'") from None
  return wandb


def transcript_text(t: dict) -> str:
  """One dialogue as plain text: each user line, then the policy's reply and the emotion after it."""
  lines = []
  for turn in t["turns"]:
    lines.append(f"user: {turn['user']}")
    if turn["policy"] is not None:
      lines.append(f"policy: {turn['policy']}")
      lines.append(f"  (emotion {turn['change']:+d} -> {turn['emotion']})")
  return "\n".join(lines)


TRANSCRIPT_COLUMNS = ["step", "profile_id", "main_cha", "task", "group_id", "turns", "termination",
                      "final_emotion", "reward", "text"]


class WandbWriter:
  def __init__(self, workdir: str, options: WandbOptions):
    self._wandb = import_wandb()
    path = epath.Path(workdir) / RUN_ID_FILE
    # 8 of [a-z0-9], as W&B's own ids.
    run_id = path.read_text().strip() if path.exists() else secrets.token_hex(4)
    try:
      # console="off": the progress bar redirects stderr itself; W&B's capture would wrap it again.
      self._run = self._wandb.init(
          project=options.project, entity=options.entity or None, name=options.run_name or None,
          id=run_id, resume="allow", config=options.config,
          settings=self._wandb.Settings(console="off"))
    except Exception as e:  # wandb raises its own errors and ValueErrors: one line either way
      raise WandbStartError(f"config.log.wandb_project={options.project!r}: W&B could not start "
                            f"the run ({type(e).__name__}: {e})") from e
    path.write_text(run_id + "\n")
    self._run.define_metric("step")
    self._run.define_metric("*", step_metric="step")
    self._failed = False

  def _log(self, step: int, data: dict[str, Any]) -> None:
    if self._failed or not data:
      return
    try:
      self._run.log({**data, "step": step})
    except Exception as e:  # logged, not raised: the run's own outputs are complete without W&B
      self._failed = True
      logging.warning("W&B logging failed at step %d (%s: %s); W&B is off for the rest of this run, "
                      "metrics.jsonl and TensorBoard are unaffected", step, type(e).__name__, e)

  def scalars(self, step: int, scalars: dict[str, Any]) -> None:
    self._log(step, {k: v for k, v in scalars.items() if isinstance(v, float)})

  def media(self, step: int, texts: dict[str, str], images: dict[str, bytes]) -> None:
    """Images by tag; texts as one table per tag prefix (eval/dialogue/PROFILE -> eval/dialogue)."""
    from PIL import Image
    data: dict[str, Any] = {tag: self._wandb.Image(Image.open(io.BytesIO(png)))
                            for tag, png in images.items()}
    rows: dict[str, list] = {}
    for tag, text in texts.items():
      key, _, name = tag.rpartition("/")
      rows.setdefault(key or tag, []).append([name, text])
    for key, table in rows.items():
      data[key] = self._wandb.Table(columns=["name", "text"], data=table)
    self._log(step, data)

  def transcripts(self, step: int, transcripts: list[dict]) -> None:
    rows = [[step, t["profile_id"], t["main_cha"], t["task"], int(t["group_id"]), len(t["turns"]),
             t["termination"], int(t["final_emotion"]), float(t["reward"]), transcript_text(t)]
            for t in transcripts]
    self._log(step, {"transcripts": self._wandb.Table(columns=TRANSCRIPT_COLUMNS, data=rows)})

  def image(self, step: int, key: str, png: bytes) -> None:
    from PIL import Image
    self._log(step, {key: self._wandb.Image(Image.open(io.BytesIO(png)))})

  def close(self) -> None:
    try:
      self._run.finish()
      # finish() returns before W&B's service has written out the run's file (wandb 0.31.0):
      # teardown waits for it, so the file is whole when close() returns (a notebook goes on).
      self._wandb.teardown()
    except Exception as e:  # as in _log: the run's outputs are already written
      logging.warning("finishing the W&B run failed (%s: %s)", type(e).__name__, e)
