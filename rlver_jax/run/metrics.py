"""Run outputs: WORKDIR/metrics.jsonl (one line per step), TensorBoard events, transcripts and a
reward plot, each also sent to Weights & Biases when config.log.wandb_project is set
(`run.wandb_writer`). Only process 0 writes; every process calls each method at the same point, so
a failed write stops all hosts together (`process_zero.on_process_zero`)."""
from __future__ import annotations

import io
import json
import math
from typing import Any

import jax
from absl import logging
from etils import epath

from rlver_jax.run.wandb_writer import WandbOptions, WandbWriter
from rlver_jax.run.workdir import replace_text
from rlver_jax.parallel.process_zero import on_process_zero


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
    self._wandb = None
    if wandb is not None:
      self._wandb = on_process_zero("starting the W&B run", lambda: WandbWriter(workdir, wandb))

  def history(self) -> list[dict]:
    """The metrics lines already written (a resumed run appends after them).

    A last line cut short (a run killed mid-write by an older version, which wrote in place) is
    dropped; an unreadable line before it is an error naming the file and line.
    """
    if not self.path.exists():
      return []
    lines = [l for l in self.path.read_text().splitlines() if l.strip()]
    rows = []
    for i, line in enumerate(lines):
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError as e:
        if i == len(lines) - 1:
          logging.warning("%s: dropping a cut-off last line (%s)", self.path, e)
          break
        raise ValueError(f"{self.path}:{i + 1}: not a JSON metrics line ({e})") from None
    return rows

  def drop_after(self, step: int) -> None:
    """Removes the rows and transcripts of steps after `step`: a resumed run restarts from its
    checkpoint, and what a later, unsaved attempt wrote must not outlive it even if the resumed run
    stops before writing anything (its next write would drop them too)."""
    on_process_zero(f"rewriting {self.path}", lambda: self._drop_after(step))

  def _drop_after(self, step: int) -> None:
    rows = self.history()
    if any(r.get("step", 0) > step for r in rows):
      kept = [json.dumps(r) for r in rows if r.get("step", 0) <= step]
      replace_text(self.path, "".join(line + "\n" for line in kept))
    for path in self.transcripts.glob("step_*.jsonl"):
      number = path.stem[len("step_"):]
      if number.isdigit() and int(number) > step:
        path.unlink()

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
    replace_text(self.path, "\n".join(lines) + "\n")
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
    path.write_text(text)
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
