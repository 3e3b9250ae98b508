"""What this CPU can do right now: memory bandwidth (1 and 2 threads), fp32 matmul throughput, and
the XLA:CPU dots of one SmolLM2-135M decode step on their own.

Gives the floors for a decode step of SmolLM2-135M in fp32 at batch 8: every step reads all ~540 MB
of weights (the tied 49152 x 576 LM head included), so step time >= weight bytes / read bandwidth;
and XLA:CPU cannot go below the time its own dot kernels take for those weights (`--xla-dots`: the
30 layers' seven projections in a `lax.scan`, distinct weights per layer so none stay in cache, plus
the LM head). That part also runs pinned to one core (`taskset -c 0`) to show whether the kernels use
the second core.

  python benchmarks/mem_bandwidth.py [--gib 1] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading

import numpy as np

import _common  # noqa: F401
from _common import best_and_median, command_line, machine_info, table

SMOL_PARAMS = 134_515_008  # SmolLM2-135M (tied embeddings)


def threaded_sum(a: np.ndarray, threads: int) -> None:
  """Sums `threads` equal parts of `a` concurrently (numpy releases the GIL inside the reduction)."""
  parts = np.array_split(a, threads)
  workers = [threading.Thread(target=p.sum) for p in parts]
  for w in workers:
    w.start()
  for w in workers:
    w.join()


def dot_weights(config, dtype):
  """Random stacked [L, ...] weights of one step's seven projections per layer, the LM head, and the
  query width."""
  import jax
  import jax.numpy as jnp
  c = config
  L, D, F, V = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  shapes = dict(wq=(L, D, q), wk=(L, D, kv), wv=(L, D, kv), wo=(L, q, D), gate=(L, D, F), up=(L, D, F),
                down=(L, F, D))
  keys = iter(jax.random.split(jax.random.key(1), 10))
  w = {n: (jax.random.normal(next(keys), s, jnp.float32) * 0.02).astype(dtype) for n, s in shapes.items()}
  head = (jax.random.normal(next(keys), (V, D), jnp.float32) * 0.02).astype(dtype)
  return w, head, q


def scanned_dots(q: int):
  """Jitted (x, stacked weights, head) -> next tokens: the step's dots in a layer scan, as the model;
  cheap elementwise glue keeps them dependent."""
  import jax
  import jax.numpy as jnp

  def layer(h, p):
    a = jnp.concatenate([h @ p["wq"], h @ p["wk"], h @ p["wv"]], -1)[:, :q]
    h = h + a @ p["wo"]
    h = h + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
    return h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True)
                             + 1e-6).astype(h.dtype)

  @jax.jit
  def step(x, w, head):
    h, _ = jax.lax.scan(lambda h, p: (layer(h, p), None), x, w)
    return jnp.argmax(h @ head.T, -1)
  return step


def xla_dots(reps: int) -> tuple[float, float, int]:
  """(best, median) seconds of the decode step's dots alone at batch 8, and the weight bytes read."""
  import jax
  import jax.numpy as jnp
  from model_shapes import SMOLLM2_135M
  w, embed, q = dot_weights(SMOLLM2_135M, jnp.float32)
  x = jax.random.normal(jax.random.key(2), (8, SMOLLM2_135M.hidden_size), jnp.float32)
  step = scanned_dots(q)
  jax.block_until_ready(step(x, w, embed))
  best, med = best_and_median(lambda: jax.block_until_ready(step(x, w, embed)), reps)
  nbytes = sum(a.nbytes for a in w.values()) + embed.nbytes
  return best, med, nbytes


def dots_row(label: str, best: float, med: float, nbytes: int) -> list:
  return [label, f"{best * 1e3:.1f} ms = {nbytes / best / 1e9:.1f} GB/s = {8 / best:.0f} tok/s",
          f"{med * 1e3:.1f} ms"]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--gib", type=float, default=1.0)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--xla-dots-only", action="store_true", help="print the XLA dots row and exit")
  args = ap.parse_args()
  if args.xla_dots_only:
    print(json.dumps(xla_dots(args.reps * 2)))
    return
  n = int(args.gib * 2**30 // 4)
  a = np.ones(n, np.float32)
  b = np.empty_like(a)
  np.copyto(b, a)
  rows = []
  best, med = best_and_median(lambda: np.copyto(b, a), args.reps)
  rows.append(["numpy copy (read + write), 1 thread, GB/s", f"{2 * a.nbytes / best / 1e9:.1f}",
               f"{2 * a.nbytes / med / 1e9:.1f}"])
  read_best = {}
  for threads in (1, 2):
    best, med = best_and_median(lambda: threaded_sum(a, threads), args.reps)
    read_best[threads] = a.nbytes / best
    rows.append([f"numpy sum (read), {threads} thread(s), GB/s", f"{a.nbytes / best / 1e9:.1f}",
                 f"{a.nbytes / med / 1e9:.1f}"])
  del a, b
  rng = np.random.default_rng(0)
  for m in (8, 2048):
    x = rng.standard_normal((m, 576), np.float32)
    w = rng.standard_normal((576, 1536), np.float32)
    best, med = best_and_median(lambda: x @ w, args.reps * 4)
    flop = 2 * m * 576 * 1536
    rows.append([f"numpy fp32 matmul [{m}, 576] x [576, 1536], GFLOP/s", f"{flop / best / 1e9:.1f}",
                 f"{flop / med / 1e9:.1f}"])
  weights = SMOL_PARAMS * 4
  best, med, nbytes = xla_dots(args.reps * 2)
  dots = [dots_row("XLA:CPU dots of one decode step, batch 8, 2 cores", best, med, nbytes)]
  if shutil.which("taskset"):
    out = subprocess.run(["taskset", "-c", "0", sys.executable, sys.argv[0], "--xla-dots-only",
                          "--reps", str(args.reps)], capture_output=True, text=True, check=True)
    best1, med1, _ = json.loads(out.stdout.strip().splitlines()[-1])
    dots.append(dots_row("same, pinned to 1 core (taskset -c 0)", best1, med1, nbytes))
  print(f"Command: `{command_line()}`\n")
  print(machine_info() + "\n")
  print(table(["measure", "best", "median"], rows))
  print()
  print(table(["measure", "best", "median"], dots))
  print(f"\nSmolLM2-135M fp32 weights: {weights / 1e6:.0f} MB -> decode step floor at the best read "
        f"bandwidth: 1 thread {weights / read_best[1] * 1e3:.0f} ms ({8 * read_best[1] / weights:.0f} "
        f"tok/s at batch 8), 2 threads {weights / read_best[2] * 1e3:.0f} ms "
        f"({8 * read_best[2] / weights:.0f} tok/s).")


if __name__ == "__main__":
  main()
