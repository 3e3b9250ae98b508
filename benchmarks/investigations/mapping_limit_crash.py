"""Reproduces the test suite's old segfault: XLA:CPU compiling once the process has used up its memory
mappings (Linux's vm.max_map_count, 65,530 by default).

Each compiled XLA:CPU program keeps a few mappings of JIT'd code. This script fills the mappings with
4 KiB anonymous maps (alternating protections, so the kernel cannot merge them) to `--leave` below the
limit, then jits small programs until one no longer fits. Expected on jaxlib 0.10.2: XLA logs
"LLVM compilation error: Cannot allocate memory" and the process dies with SIGSEGV in the unwinder
(_Unwind_Find_FDE under xla::ValueOrThrow), as an xdist worker did after compiling thousands of programs;
tests/fixtures/memory_maps.py keeps the suite's workers far from the limit. Run it under
`gdb -batch -ex run -ex bt --args python ...` for the native frames.

  python benchmarks/investigations/mapping_limit_crash.py [--leave 300]
"""
from __future__ import annotations

import argparse
import mmap
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def mappings() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--leave", type=int, default=300, help="mappings left free before compiling")
  args = ap.parse_args()
  with open("/proc/sys/vm/max_map_count") as f:
    limit = int(f.read())
  held = []
  while mappings() < limit - args.leave:
    for _ in range(500):
      prot = mmap.PROT_READ if len(held) % 2 else mmap.PROT_READ | mmap.PROT_WRITE
      held.append(mmap.mmap(-1, 4096, prot=prot))
  print(f"mappings {mappings()} of {limit}; compiling", flush=True)
  for k in range(100):
    f = jax.jit(lambda x, k=k: jnp.tanh(jnp.sin(x @ x.T + k) * 3).sum(0) * k)
    f(jnp.ones((16 + k, 32))).block_until_ready()
    print(f"program {k}: {mappings()} mappings", flush=True)
  print("every program compiled: no crash at this jaxlib")


if __name__ == "__main__":
  main()
