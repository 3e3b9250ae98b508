"""What XLA:TPU charges for one decode step's attention over a slots-major KV window, per byte of k and v.

Compiled ahead of time for one v5p chip with libtpu (no TPU needed): a row's q (G query heads for
each of K kv heads) against the first W slots of a bf16 [B, S, K, Dh] cache, as
`CacheView._layer_window` and `models.qwen2` do it (dynamic slice, transpose to [B, K, W, Dh], fp32
scores, masked softmax, p.v). The cost analysis' bytes over the window's k and v bytes say what a
filled slot costs beyond its own bytes; `copies` counts arrays of [.., window, .., head_dim] in the
compiled program: k or v windows (or their transposes) made as arrays of their own instead of read
from the cache in place.

  python benchmarks/investigations/tpu_attention_bytes.py [--rows 16,64] [--kv_heads 1,2] [--group 8]
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # _common
import _common  # noqa: F401
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlver_jax.aot.topology import get_topology


def attention(q, k, v, lengths, window: int):
  """q [B, K, G, Dh]; k, v [B, S, K, Dh]: the first `window` slots, read heads-major."""
  kw = jax.lax.dynamic_slice_in_dim(k, 0, window, 1).transpose(0, 2, 1, 3)
  vw = jax.lax.dynamic_slice_in_dim(v, 0, window, 1).transpose(0, 2, 1, 3)
  s = jnp.einsum("bkgd,bkwd->bkgw", q, kw, preferred_element_type=jnp.float32)
  s = jnp.where(jnp.arange(window) < lengths[:, None, None, None], s, -1e30)
  return jnp.einsum("bkgw,bkwd->bkgd", jax.nn.softmax(s, -1).astype(v.dtype), vw)


def measure(rows: int, kv_heads: int, group: int, window: int, slots: int, head_dim: int = 128):
  mesh = Mesh(get_topology("v5p:2x2x1")[:1], ("x",))
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
  cache = spec((rows, slots, kv_heads, head_dim), jnp.bfloat16)
  args = (spec((rows, kv_heads, group, head_dim), jnp.bfloat16), cache, cache,
          spec((rows,), jnp.int32))
  compiled = jax.jit(functools.partial(attention, window=window)).lower(*args).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  kv = rows * window * kv_heads * 2 * head_dim * 2
  entry = compiled.as_text().partition("\nENTRY")[2].splitlines()[1:]
  dims = [m.group(1).split(",") for line in entry if "parameter(" not in line
          and (m := re.search(r"= \w+\[([\d,]+)\]", line))]
  copies = sum(1 for d in dims if str(window) in d and d[-1] == str(head_dim))
  return cost["bytes accessed"] / kv, copies


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="16,64")
  parser.add_argument("--kv_heads", default="1,2")
  parser.add_argument("--group", type=int, default=8, help="query heads per kv head (72B: 8, 7B: 7)")
  parser.add_argument("--windows", default="1024,2048,4096,8192,16384")
  args = parser.parse_args()
  windows = [int(w) for w in args.windows.split(",")]
  print(f"one v5p chip (libtpu AOT), G={args.group}, Dh=128, bf16 cache of {windows[-1]} slots")
  print("| rows | kv heads a chip | window | bytes / k and v bytes | k/v window copies |")
  print("| --- | --- | --- | --- | --- |")
  for rows in (int(r) for r in args.rows.split(",")):
    for kv_heads in (int(k) for k in args.kv_heads.split(",")):
      for w in windows:
        ratio, copies = measure(rows, kv_heads, args.group, w, windows[-1])
        print(f"| {rows} | {kv_heads} | {w} | {ratio:.3f} | {copies} |", flush=True)


if __name__ == "__main__":
  main()
