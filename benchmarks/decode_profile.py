"""Where a decode step's time goes, op by op: our sampler's decode under `jax.profiler`, with the
trace's events summed by name (XLA thunks on CPU, kernels on a GPU) and divided by the decoded steps.

Random weights of a named shape (model_shapes.py), batch `--batch`, a `--prompt`-token prefill and
`--new` greedy tokens per row, after one untraced warm-up call. Events of every thread / stream are
summed, so on a multi-threaded CPU the shares are of busy thread time, not of wall time; tracing
slows the run, so read shares, not absolute times.

  python decode_profile.py --model smollm2-135m:float32                  # CPU
  JAX_PLATFORMS=cuda python decode_profile.py --model qwen2.5-7b:bfloat16   # a GPU
"""
from __future__ import annotations

import argparse
import collections
import glob
import tempfile

import _common  # noqa: F401  (JAX_PLATFORMS=cpu unless the caller set it)
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _common import command_line, machine_info, table
from model_shapes import shape_config
from rlver_jax.models import create_model
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams

# Events that contain other events (the executor, loops and branches around their bodies' ops) or
# are not the program's (compiles of small host-side programs): summing them would count twice.
_ENVELOPES = ("ThunkExecutor::Execute", "PjitFunction", "wait for completion", "$", "Compile",
              "RunBackend")
_ENVELOPE_PREFIXES = ("while", "conditional", "call")


def op_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter, dict[str, str]]:
  """(total ns by event name, calls by name, a plane name per event name) over the trace's events."""
  path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
  total, calls, plane_of = collections.Counter(), collections.Counter(), {}
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    for line in plane.lines:
      if line.name == "python":
        continue
      for ev in line.events:
        if any(e in ev.name for e in _ENVELOPES) or ev.name.startswith(_ENVELOPE_PREFIXES):
          continue
        total[ev.name] += ev.duration_ns
        calls[ev.name] += 1
        plane_of.setdefault(ev.name, plane.name)
  return total, calls, plane_of


def kind(name: str) -> str:
  """A coarse class for an op name, so a table of hundreds of fusions reads at a glance."""
  n = name.lower()
  for key, label in (("dynamic-slice", "slice copy"), ("dynamic_slice", "slice copy"),
                     ("dynamic-update-slice", "cache write"), ("scatter", "cache write"),
                     ("gemm", "matmul"), ("dot", "matmul"), ("ynn", "matmul"), ("xnn", "matmul"),
                     ("cublas", "matmul"), ("convolution", "matmul"), ("copy", "copy"),
                     ("reduce", "reduction")):
    if key in n:
      return label
  return "other"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="smollm2-135m:float32", help="SHAPE:DTYPE (model_shapes.py)")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=64)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--top", type=int, default=25, help="rows of the per-op table")
  args = ap.parse_args()
  shape, dtype = args.model.split(":")
  config = shape_config(shape)
  dtype = jnp.dtype(dtype)
  model = create_model(config, param_dtype=dtype, dtype=dtype)
  params = nnx.state(model)
  prompts = np.random.default_rng(0).integers(3, config.vocab_size - 1, (args.batch, args.prompt)).tolist()
  sampler = Sampler(model, max_len=args.prompt + args.new + 1, stop_ids=[-1], pad_id=0)

  def decode():
    cache, logits = sampler.prefill(params, sampler.init_cache(args.batch), prompts)
    jax.block_until_ready(logits)
    res = sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=args.new,
                         sampling=SamplingParams.make(0.0))
    assert (res.num_tokens == args.new).all()

  decode()  # compile
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      decode()
    total, calls, plane_of = op_times(tmp)

  steps = args.new
  busy = sum(total.values())
  by_kind = collections.Counter()
  for name, ns in total.items():
    by_kind[kind(name)] += ns
  print(f"Command: `{command_line()}`\n")
  print(machine_info() + "\n")
  print(f"{shape} {dtype.name}, batch {args.batch}, prompt {args.prompt}, {steps} greedy steps traced "
        f"(the prefill is in the trace too). Busy time summed over threads/streams, under the profiler: "
        f"{busy / 1e6 / steps:.2f} ms per step.\n")
  print(table(["kind", "ms per step", "share"],
              [[k, f"{ns / 1e6 / steps:.2f}", f"{ns / busy:.1%}"] for k, ns in by_kind.most_common()]))
  print()
  print(table(["op", "kind", "where", "calls per step", "ms per step", "share"],
              [[name[:60], kind(name), plane_of[name][:24], f"{calls[name] / steps:.1f}",
                f"{ns / 1e6 / steps:.3f}", f"{ns / busy:.1%}"]
               for name, ns in total.most_common(args.top)]))


if __name__ == "__main__":
  main()
