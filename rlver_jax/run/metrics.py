"""Run outputs: WORKDIR/metrics.jsonl (one line per step), TensorBoard events, transcripts and a
reward plot, each also sent to Weights & Biases when config.log.wandb_project is set
(`run.wandb_writer`). Only process 0 writes; every process calls each method at the same point, so
a failed write stops all hosts together (`process_zero.on_process_zero`)."""
from __future__ import annotations

import datetime
import io
import json
import math
import re
from typing import Any

import jax
from absl import logging
from etils import epath

from rlver_jax.run.wandb_writer import WandbOptions, WandbWriter
from rlver_jax.run.workdir import replace_text
from rlver_jax.parallel.process_zero import on_process_zero

SET_ASIDE = "set_aside"  # WORKDIR/set_aside/: rows and transcripts a resumed run no longer shows
_STEP = re.compile(r'^\{"step": (\d+)')


class NotWritten(OSError):
  """A run file could not be written (a full disk); the message names the file and the step."""


def _reason(e: OSError) -> str:
  return e.strerror or str(e) or type(e).__name__


def _span(steps: list[int]) -> str:
  contiguous = steps == list(range(steps[0], steps[-1] + 1))
  return f"{steps[0]}-{steps[-1]}" if contiguous and len(steps) > 1 else ", ".join(map(str, steps))


def _scalar(v: Any) -> Any:
  try:
    f = float(v)
  except (TypeError, ValueError):
    return v
  return f if math.isfinite(f) else None


class MetricsWriter:
  def __init__(self, workdir: str, *, tensorboard: bool = True, wandb: WandbOptions | None = None):
    self.workdir = epath.Path(workdir)
    self.enabled = jax.process_index() == 0
    self.path = self.workdir / "metrics.jsonl"
    self.transcripts = self.workdir / "transcripts"
    self._tb = None
    self._tensorboard = tensorboard and self.enabled
    on_process_zero(f"creating {self.transcripts}",
                    lambda: self.transcripts.mkdir(parents=True, exist_ok=True))
    on_process_zero(f"reading {self.path}", self._repair_cut_line)
    self._wandb = None
    if wandb is not None:
      self._wandb = on_process_zero("starting the W&B run", lambda: WandbWriter(workdir, wandb))

  def history(self) -> list[dict]:
    """The metrics lines already written (a resumed run appends after them); a line that is not
    JSON is an error naming the file and line (a cut last line was set aside at start)."""
    return [row for _, row in self._parsed(self._lines())]

  def _lines(self) -> list[str]:
    return [l for l in self.path.read_text().splitlines() if l.strip()] if self.path.exists() else []

  def _parsed(self, lines: list[str]):
    for i, line in enumerate(lines):
      try:
        yield i, json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{self.path}:{i + 1}: not a JSON metrics line ({e})") from None

  def _repair_cut_line(self) -> None:
    """A last line cut short (a copy interrupted, an older version killed mid-write, which wrote in
    place) is moved into the set-aside folder once, with one warning; the rows before it stay."""
    lines = self._lines()
    if not lines:
      return
    try:
      json.loads(lines[-1])
    except json.JSONDecodeError as e:
      kept = lines[:-1]
      list(self._parsed(kept))  # an unreadable line before it is an error naming it
      folder = self._set_aside_folder("cut_line")
      (folder / "metrics.jsonl").write_text(lines[-1] + "\n")
      replace_text(self.path, "".join(line + "\n" for line in kept))
      step = _STEP.match(lines[-1])
      logging.warning("%s: its last line%s is cut short (%s): moved it to %s, the %d row(s) before it "
                      "are kept", self.path, f" (step {step.group(1)})" if step else "", e.msg,
                      folder / "metrics.jsonl", len(kept))

  def drop_after(self, step: int) -> None:
    """Takes the rows and transcripts of steps after `step` out of the run's files (a resumed run
    restarts from its checkpoint and redoes them) into WORKDIR/set_aside/, with one warning line
    saying where: what an earlier run wrote is never deleted. Step 0: there is no checkpoint."""
    on_process_zero(f"setting aside the rows after step {step} of {self.path}",
                    lambda: self._drop_after(step))

  def _drop_after(self, step: int) -> None:
    rows = self.history()
    later = [r for r in rows if r.get("step", 0) > step]
    transcripts = [p for p in self.transcripts.glob("step_*.jsonl")
                   if p.stem[len("step_"):].isdigit() and int(p.stem[len("step_"):]) > step]
    if not later and not transcripts:
      return
    folder = self._set_aside_folder(f"after_step_{step}")
    if transcripts:
      (folder / "transcripts").mkdir(parents=True, exist_ok=True)
      for path in transcripts:  # copied, then removed: a gs:// "folder" cannot be renamed into
        (folder / "transcripts" / path.name).write_bytes(path.read_bytes())
        path.unlink()
    if later:  # copied before metrics.jsonl is rewritten: a kill in between loses nothing
      (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in later))
      replace_text(self.path, "".join(json.dumps(r) + "\n" for r in rows
                                      if r.get("step", 0) <= step))
    steps = sorted({r.get("step", 0) for r in later} |
                   {int(p.stem[len("step_"):]) for p in transcripts})
    what = " and ".join(x for x in (f"{len(later)} metrics row(s)" if later else "",
                                    f"{len(transcripts)} transcript file(s)" if transcripts else "")
                        if x)
    where = ("there is no checkpoint to resume from, so the run starts over from step 0"
             if step == 0 else f"the run resumes from the checkpoint of step {step} and redoes them")
    logging.warning("%s of step(s) %s: %s; moved them to %s", what, _span(steps), where, folder)

  def _set_aside_folder(self, name: str) -> epath.Path:
    """A new WORKDIR/set_aside/NAME-TIME folder (-2, -3, ... if taken)."""
    stem = f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    folder, n = self.workdir / SET_ASIDE / stem, 2
    while folder.exists():
      folder, n = self.workdir / SET_ASIDE / f"{stem}-{n}", n + 1
    folder.mkdir(parents=True)
    return folder

  def write(self, step: int, metrics: dict[str, Any], *, merge: bool = False) -> None:
    """Writes `step`'s row, dropping rows of later steps (a resumed run redoes them); with `merge`
    the metrics are added to the row already written for `step`."""
    on_process_zero(f"writing {self.path}", lambda: self._write(step, metrics, merge))

  def _write(self, step: int, metrics: dict[str, Any], merge: bool) -> None:
    rows = self.history()
    scalars = {k: _scalar(v) for k, v in metrics.items()}
    new = {**next((r for r in rows if r.get("step") == step), {}), **scalars} if merge else scalars
    row = {"step": step, **{k: v for k, v in sorted(new.items()) if k != "step"}}
    lines = [json.dumps(r) for r in rows if r.get("step", 0) < step] + [json.dumps(row)]
    try:
      replace_text(self.path, "\n".join(lines) + "\n")
    except OSError as e:
      last = f"step {rows[-1].get('step')}" if rows else "no step"
      raise NotWritten(f"could not write the row of step {step} to {self.path} ({_reason(e)}); "
                       f"the file is unchanged (its last row: {last})") from e
    tb = self._board(step)
    if tb is not None:
      for k, v in scalars.items():  # only this call's metrics: merged ones were added before
        if isinstance(v, float):
          tb.add_scalar(k, v, step)
      tb.flush()
    if self._wandb is not None:
      self._wandb.scalars(step, scalars)

  def _board(self, step: int):
    if self._tensorboard and self._tb is None:
      # Opened at the first step written: a resumed run hides the events of the steps it redoes
      # (TensorBoard's purge_step), as metrics.jsonl drops their rows.
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(self.workdir / "tensorboard"), purge_step=step)
    return self._tb

  def write_board_media(self, step: int, texts: dict[str, str], images: dict[str, bytes]) -> None:
    """TensorBoard and W&B only: Markdown texts (the text tab) and PNG images (the images tab) by
    tag."""
    on_process_zero(f"writing TensorBoard events under {self.workdir}",
                    lambda: self._write_media(step, texts, images))

  def _write_media(self, step: int, texts: dict[str, str], images: dict[str, bytes]) -> None:
    if self._wandb is not None:
      self._wandb.media(step, texts, images)
    tb = self._board(step)
    if tb is None:
      return
    import numpy as np
    from PIL import Image
    for tag, text in texts.items():
      tb.add_text(tag, text, step)
    for tag, png in images.items():
      tb.add_image(tag, np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), step,
                   dataformats="HWC")
    tb.flush()

  def write_transcripts(self, step: int, transcripts: list[dict]) -> epath.Path | None:
    path = self.transcripts / f"step_{step:06d}.jsonl"
    text = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in transcripts)
    on_process_zero(f"writing {path}", lambda: self._write_transcripts(path, text, step, transcripts))
    return path if self.enabled else None

  def _write_transcripts(self, path: epath.Path, text: str, step: int, transcripts: list[dict]):
    try:
      replace_text(path, text)
    except OSError as e:
      raise NotWritten(f"could not write the transcripts of step {step} to {path} "
                       f"({_reason(e)})") from e
    if self._wandb is not None:
      self._wandb.transcripts(step, transcripts)

  def plot_rewards(self) -> epath.Path | None:
    """Writes WORKDIR/reward.png; returns its path (None on other processes or before any step)."""
    return on_process_zero(f"writing {self.workdir / 'reward.png'}", self._plot_rewards)

  def _plot_rewards(self) -> epath.Path | None:
    rows = self.history()
    if not rows:
      return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r.get("reward_mean") for r in rows], marker="o", label="reward mean")
    ax.set_xlabel("step")
    ax.set_ylabel("reward (final emotion / 100)")
    ax.grid(alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    path = self.workdir / "reward.png"
    path.write_bytes(buf.getvalue())
    if self._wandb is not None:
      self._wandb.image(steps[-1], "reward_plot", buf.getvalue())
    return path

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.close()
      self._wandb = None
