"""Fused GRPO update throughput for SmolLM2-135M at the `:runlocal` shapes, and a real run's time split.

Part 1 builds a batch the way `Trainer.make_batch` does (samples packed to the trainer's shape
buckets, [M, B, T] with B = micro_batch_size, old log-probs from a forward pass of the same params,
GRPO advantages on the loss-masked tokens) and times `Updater.step` (fp32, full remat, micro-batch 2,
logits chunk 256, as `:runlocal`). Tokens/s counts every packed token, padding included; the
trainer's `update_tokens_per_s` counts real tokens only (since session 6; older result tables
counted padding there too).

Part 2 runs `python -m rlver_jax.main --config=configs/grpo_think.py:runlocal --config.total_steps=2`
in a fresh workdir and reads `rollout_seconds` / `update_seconds` from its metrics.jsonl.

  python benchmarks/update_throughput.py [--samples 8] [--seq 600] [--masked 100] [--reps 3] [--skip-run]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import _common  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _common import CompileCounter, command_line, machine_info, median, table
from rlver_jax.models import load_pretrained
from rlver_jax.models.embedded import embedded_model_dir
from rlver_jax.rl.update import LossConfig, OptimConfig, Updater, make_optimizer, token_logprobs_and_entropy
from rlver_jax.rl.batch import SEQ_MULTIPLE, UpdateBatch, shape_bucket

RUN_FIELDS = ("rollout_seconds", "update_seconds", "rollout_fraction", "update_tokens_per_s",
              "rollout_policy_tokens_per_s", "policy_tokens", "samples", "turns_mean")


def make_host_batch(samples: int, seq: int, masked: int, micro: int, vocab: int, seed: int = 0):
  """[M, B, T] arrays like make_batch: right-padded to the shape buckets, loss mask on the tail."""
  rng = np.random.default_rng(seed)
  T = shape_bucket(seq, SEQ_MULTIPLE)
  N = shape_bucket(samples, micro)
  lengths = rng.integers(seq - 50, seq + 1, size=samples)
  tokens = np.zeros((N, T), np.int32)
  seg, mask = np.zeros((N, T), np.int32), np.zeros((N, T), np.float32)
  for i, L in enumerate(lengths):
    tokens[i, :L] = rng.integers(0, vocab, size=L)
    seg[i, :L] = 1
    mask[i, L - masked:L] = 1
  adv = (rng.standard_normal(N).astype(np.float32)[:, None] * mask)
  logp = np.where(mask > 0, -rng.random((N, T)).astype(np.float32), 0.0)
  shape = (N // micro, micro, T)
  return {"tokens": tokens.reshape(shape), "segment_ids": seg.reshape(shape),
          "loss_mask": mask.reshape(shape), "advantages": adv.reshape(shape),
          "rollout_logp": logp.reshape(shape)}


def old_logp_fn(updater: Updater, chunk: int):
  """The trainer's old-log-prob forward (lax.map over micro-batches), jitted."""
  def fn(params, tokens, seg):
    model = nnx.merge(updater.graphdef, params, updater.rest)
    return jax.lax.map(lambda a: token_logprobs_and_entropy(model, a[0], a[1], chunk)[0], (tokens, seg))
  return jax.jit(fn)


def bench_update(args) -> tuple[str, dict]:
  path = embedded_model_dir()
  model, config = load_pretrained(path, dtype=jnp.float32, param_dtype=jnp.float32, remat=args.remat)
  loss = LossConfig(logits_chunk=args.chunk)
  up = Updater(model, make_optimizer(OptimConfig(learning_rate=1e-5)), "policy", loss)
  params = nnx.state(model, nnx.Param)
  opt = up.init(params)
  host = make_host_batch(args.samples, args.seq, args.masked, args.micro, config.vocab_size)
  logp_fn = old_logp_fn(up, args.chunk)
  counter = CompileCounter()

  def one_step(params, opt):
    t0 = time.perf_counter()
    arrays = {k: jnp.asarray(v) for k, v in host.items()}
    old_logp = jax.block_until_ready(logp_fn(params, arrays["tokens"], arrays["segment_ids"]))
    t1 = time.perf_counter()
    params, opt, metrics = up.step(params, opt, UpdateBatch(**arrays, old_logp=old_logp))
    jax.block_until_ready((params, opt, metrics))
    return params, opt, t1 - t0, time.perf_counter() - t1

  counter.reset()
  t0 = time.perf_counter()
  params, opt, _, _ = one_step(params, opt)
  first = time.perf_counter() - t0
  compiles, compile_s = counter.count, counter.seconds + counter.frontend_seconds
  fwd, upd = [], []
  for rep in range(args.reps):
    params, opt, a, b = one_step(params, opt)
    fwd.append(a)
    upd.append(b)
    print(f"rep {rep}: old-logp forward {a:.2f} s, update step {b:.2f} s", flush=True)
  M, B, T = host["tokens"].shape
  n_tok, n_masked = M * B * T, int(host["loss_mask"].sum())
  f, u = median(fwd), median(upd)
  out = table(["item", "value"], [
      ["batch [M, B, T]", f"[{M}, {B}, {T}] = {n_tok:,} tokens ({n_masked:,} loss-masked)"],
      ["first step incl. compile, s", f"{first:.1f} ({compiles} XLA programs, {compile_s:.1f} s compile+trace)"],
      ["old-logp forward, s (median)", f"{f:.2f}"],
      ["update step (fwd+bwd+AdamW), s (median)", f"{u:.2f}"],
      ["update tokens/s (all packed tokens)", f"{n_tok / u:.0f}"],
      ["update tokens/s incl. the old-logp forward (what train.py reports)", f"{n_tok / (u + f):.0f}"],
      ["loss-masked tokens/s (update step)", f"{n_masked / u:.0f}"],
      ["achieved GFLOP/s (6 x 135M params x tokens / update s; attention excluded)",
       f"{6 * config.num_params() * n_tok / u / 1e9:.1f}"],
  ])
  return out, {"tokens_per_s": n_tok / u}


def run_local(workdir: str, steps: int) -> str:
  """Runs the real trainer for `steps` steps in a fresh workdir; returns a table of its metrics."""
  if os.path.exists(workdir):
    shutil.rmtree(workdir)
  cmd = [sys.executable, "-m", "rlver_jax.main", "--config=configs/grpo_think.py:runlocal",
         f"--config.total_steps={steps}", f"--workdir={workdir}", "--config.log.progress_bar=false"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
  wall = time.perf_counter() - t0
  if proc.returncode:
    sys.stderr.write(proc.stderr[-4000:])
    raise SystemExit(f"runlocal failed with exit code {proc.returncode}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  header = ["step"] + list(RUN_FIELDS)
  body = [[r["step"]] + [f"{r[k]:.3g}" if k in r else "-" for k in RUN_FIELDS] for r in rows]
  return (f"`{' '.join(cmd[1:])}` (wall {wall:.0f} s for the whole process, incl. loading and "
          f"compiles)\n\n" + table(header, body))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--seq", type=int, default=600, help="longest sample (others up to 50 shorter)")
  ap.add_argument("--masked", type=int, default=100, help="loss-masked tokens at the end of each sample")
  ap.add_argument("--micro", type=int, default=2, help="micro_batch_size (runlocal: 2)")
  ap.add_argument("--remat", default="full", help="none | full | dots (runlocal: full)")
  ap.add_argument("--chunk", type=int, default=256, help="logits_chunk (runlocal: 256)")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--skip-run", action="store_true", help="skip the real 2-step training run")
  ap.add_argument("--workdir", default="/tmp/bench_run")
  ap.add_argument("--steps", type=int, default=2)
  args = ap.parse_args()

  update_table, _ = bench_update(args)
  run_table = None if args.skip_run else run_local(args.workdir, args.steps)
  print()
  print(f"Command: `{command_line()}`\n")
  print(machine_info() + "\n")
  print(f"Fused GRPO update, SmolLM2-135M fp32 params and compute, remat={args.remat}, micro-batch "
        f"{args.micro}, logits chunk {args.chunk}, AdamW, {args.reps} reps "
        f"after a compile step, medians.\n")
  print(update_table)
  if run_table:
    print("\nReal run:\n")
    print(run_table)


if __name__ == "__main__":
  main()
