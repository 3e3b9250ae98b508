"""Run outputs: WORKDIR/metrics.jsonl (one line per step), TensorBoard events, transcripts and a
reward plot. Only process 0 writes; other hosts get no-op writers."""
from __future__ import annotations

import io
import json
import math
from typing import Any

import jax
from etils import epath


def _scalar(v: Any) -> Any:
  try:
    f = float(v)
  except (TypeError, ValueError):
    return v
  return f if math.isfinite(f) else None


class MetricsWriter:
  def __init__(self, workdir: str, *, tensorboard: bool = True):
    self.workdir = epath.Path(workdir)
    self.enabled = jax.process_index() == 0
    self.path = self.workdir / "metrics.jsonl"
    self.transcripts = self.workdir / "transcripts"
    self._tb = None
    if self.enabled:
      self.workdir.mkdir(parents=True, exist_ok=True)
      self.transcripts.mkdir(parents=True, exist_ok=True)
      if tensorboard:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(str(self.workdir / "tensorboard"))

  def history(self) -> list[dict]:
    """The metrics lines already written (a resumed run appends after them)."""
    if not self.path.exists():
      return []
    return [json.loads(l) for l in self.path.read_text().splitlines() if l.strip()]

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.enabled:
      return
    row = {"step": step, **{k: _scalar(v) for k, v in sorted(metrics.items())}}
    # Rewritten whole so a gs:// workdir (no append) works the same as a local one.
    lines = [json.dumps(r) for r in self.history() if r.get("step", 0) < step] + [json.dumps(row)]
    self.path.write_text("\n".join(lines) + "\n")
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, float):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()

  def write_transcripts(self, step: int, transcripts: list[dict]) -> epath.Path | None:
    if not self.enabled:
      return None
    path = self.transcripts / f"step_{step:06d}.jsonl"
    path.write_text("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in transcripts))
    return path

  def plot_rewards(self) -> epath.Path | None:
    if not self.enabled:
      return None
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
    return path

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
