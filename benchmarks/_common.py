"""Shared helpers for the benchmarks: CPU-only JAX, machine description, compile counting, tables."""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib
import platform
import statistics
import subprocess
import sys
import time

import jax

REPO = pathlib.Path(__file__).resolve().parents[1]
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Tracing and lowering happen before each backend compile; their time is also compile overhead.
FRONTEND_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration")


class CompileCounter:
  """Counts XLA backend compiles (and their seconds) between `reset()` and now.

  `seconds` is backend (XLA) compile time; `frontend_seconds` is jaxpr tracing + MLIR lowering.
  """

  def __init__(self):
    self.reset()
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, fun_name: str = "?", **_) -> None:
    if event == COMPILE_EVENT:
      self.count += 1
      self.seconds += duration
      self.names[fun_name] = self.names.get(fun_name, 0) + 1
    elif event in FRONTEND_EVENTS:
      self.frontend_seconds += duration

  def reset(self) -> None:
    self.count, self.seconds, self.frontend_seconds = 0, 0.0, 0.0
    self.names: dict[str, int] = {}

  def programs(self) -> str:
    """Compiled programs by function name, e.g. '_decode_fn x4, zeros x1'."""
    return ", ".join(f"{k} x{v}" for k, v in sorted(self.names.items(), key=lambda kv: -kv[1]))

  def snapshot(self) -> tuple[int, float]:
    return self.count, self.seconds


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def _ram_gib() -> float:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal"):
          return int(line.split()[1]) / 2**20
  except OSError:
    pass
  return float("nan")


def _load() -> str:
  try:
    return " ".join(open("/proc/loadavg").read().split()[:3])
  except OSError:
    return "?"


def machine_info(with_torch: bool = False) -> str:
  """One Markdown line: cores, CPU, RAM, load average and library versions."""
  parts = [f"nproc={os.cpu_count()}", f"cpu={_cpu_model()}", f"ram={_ram_gib():.1f} GiB",
           f"loadavg={_load()}", f"python={platform.python_version()}", f"jax={jax.__version__}"]
  if with_torch:  # the transformers peer's, in the .venv-torch worker
    v = torch_reference().worker().request("versions")
    parts += [f"torch={v['torch']} (.venv-torch worker, python={v['python']})",
              f"transformers={v['transformers']}"]
  return "Machine: " + ", ".join(parts)


def torch_reference(**env):
  """The parity tests' torch client (tests/fixtures/torch_reference.py) with its worker started in
  .venv-torch: the transformers peer runs there, never in this process. `env` overrides the worker's
  environment (default OMP_WAIT_POLICY=PASSIVE). Exits with one line if that venv is absent."""
  fixtures = str(REPO / "tests" / "fixtures")
  if fixtures not in sys.path:
    sys.path.append(fixtures)
  import torch_reference as ref
  if not ref.available():
    raise SystemExit(f"{os.path.basename(sys.argv[0])}: {ref.SKIP_REASON}")
  ref.start(**env)
  return ref


def torch_here():
  """torch imported in this process, for the scripts that run it beside jax; else a one-line exit."""
  try:
    import torch
  except ImportError:
    raise SystemExit(f"{os.path.basename(sys.argv[0])}: needs torch in this Python beside jax; there is "
                     "none for the project's .venv (the CPU torch wheel is for Python 3.11, jax 0.12 needs "
                     "3.12) and .venv-torch has no jax: run it where one Python has both") from None
  return torch


def command_line() -> str:
  return "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def timed(fn, *args, **kwargs):
  """(result, seconds) of one call."""
  t0 = time.perf_counter()
  out = fn(*args, **kwargs)
  return out, time.perf_counter() - t0


def median(xs) -> float:
  return statistics.median(xs)


def best_and_median(fn, reps: int) -> tuple[float, float]:
  """(best, median) seconds of `reps` calls of fn (which must wait for its own result)."""
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return min(ts), median(ts)


def table(header: list[str], rows: list[list]) -> str:
  """A Markdown table; floats are formatted with 3 significant digits unless already strings."""
  def fmt(x):
    if isinstance(x, float):
      return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
  return "\n".join(lines)


def git_rev() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "?"
