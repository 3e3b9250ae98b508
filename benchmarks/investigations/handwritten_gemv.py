"""Would a hand-written CPU kernel lift the decode step's dots? A probe, not a code path.

The SmolLM2-135M decode step at batch 8 is [8, K] x [K, N] products over ~540 MB of fp32 weights;
XLA:CPU's dots stream them at well under the machine's read bandwidth (`mem_bandwidth.py`). This
builds a small AVX-512 kernel (g++, OpenMP over the output columns, no weight packing, weights in
our [in, out] layout and the tied head as [vocab, embed]) and times one step's dots with it next to
XLA's scanned dots and numpy, on the same shapes, in one run. Needs g++ and AVX-512.

  python benchmarks/investigations/handwritten_gemv.py [--reps 7]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # _common, model_shapes
import _common  # noqa: F401
from _common import best_and_median, command_line, machine_info, table
from mem_bandwidth import dots_row, xla_dots
from model_shapes import SMOLLM2_135M

# y[M, N] = x[M, K] @ w[K, N] (w row-major), and y[M, V] = x[M, D] @ e[V, D]^T for the tied head.
# Rows in groups of up to 8 held in registers; w read in blocks of KB rows so each block streams
# KB contiguous row segments (prefetch-friendly); threads split the output columns.
KERNEL = r"""
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>

template <int MB, int NW>
static inline void tile(const float* x, int ldx, const float* w, int64_t ldw, float* y, int ldy,
                        int k0, int k1, bool first) {
  __m512 acc[MB][NW];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NW; ++j)
      acc[m][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * ldy + 16 * j);
  for (int k = k0; k < k1; ++k) {
    __m512 wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = _mm512_loadu_ps(w + k * ldw + 16 * j);
    for (int m = 0; m < MB; ++m) {
      __m512 b = _mm512_set1_ps(x[m * ldx + k]);
      for (int j = 0; j < NW; ++j) acc[m][j] = _mm512_fmadd_ps(b, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NW; ++j) _mm512_storeu_ps(y + m * ldy + 16 * j, acc[m][j]);
}

template <int MB>
static void columns(const float* x, const float* w, float* y, int K, int N, int n0, int n1) {
  const int KB = 16;
  for (int k0 = 0; k0 < K; k0 += KB) {
    int k1 = std::min(K, k0 + KB), n = n0;
    for (; n + 32 <= n1; n += 32) tile<MB, 2>(x, K, w + n, N, y + n, N, k0, k1, k0 == 0);
    for (; n + 16 <= n1; n += 16) tile<MB, 1>(x, K, w + n, N, y + n, N, k0, k1, k0 == 0);
    for (; n < n1; ++n)
      for (int m = 0; m < MB; ++m) {
        float s = k0 == 0 ? 0.f : y[m * N + n];
        for (int k = k0; k < k1; ++k) s += x[m * K + k] * w[(int64_t)k * N + n];
        y[m * N + n] = s;
      }
  }
}

static void rows(const float* x, const float* w, float* y, int M, int K, int N, int n0, int n1) {
  for (int m0 = 0; m0 < M; m0 += 8) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    switch (std::min(8, M - m0)) {
      case 8: columns<8>(xm, w, ym, K, N, n0, n1); break;
      case 7: columns<7>(xm, w, ym, K, N, n0, n1); break;
      case 6: columns<6>(xm, w, ym, K, N, n0, n1); break;
      case 5: columns<5>(xm, w, ym, K, N, n0, n1); break;
      case 4: columns<4>(xm, w, ym, K, N, n0, n1); break;
      case 3: columns<3>(xm, w, ym, K, N, n0, n1); break;
      case 2: columns<2>(xm, w, ym, K, N, n0, n1); break;
      default: columns<1>(xm, w, ym, K, N, n0, n1); break;
    }
  }
}

extern "C" void matmul(const float* x, const float* w, float* y, int M, int K, int N) {
  #pragma omp parallel
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int per = ((N + T - 1) / T + 15) / 16 * 16;
    int a = std::min(N, t * per), b = std::min(N, a + per);
    if (a < b) rows(x, w, y, M, K, N, a, b);
  }
}

extern "C" void matmul_transposed(const float* x, const float* e, float* y, int M, int D, int V) {
  #pragma omp parallel
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int per = ((V + T - 1) / T + 3) / 4 * 4;
    int v0 = std::min(V, t * per), v1 = std::min(V, v0 + per);
    for (int v = v0; v < v1; v += 4) {
      int nv = std::min(4, v1 - v);
      for (int m0 = 0; m0 < M; m0 += 4) {
        int nm = std::min(4, M - m0);
        __m512 acc[4][4];
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 16) {
          __mmask16 mask = D - d >= 16 ? 0xFFFF : (__mmask16)((1u << (D - d)) - 1);
          __m512 ev[4], xv[4];
          for (int j = 0; j < 4; ++j)
            ev[j] = j < nv ? _mm512_maskz_loadu_ps(mask, e + (int64_t)(v + j) * D + d) : _mm512_setzero_ps();
          for (int i = 0; i < 4; ++i)
            xv[i] = i < nm ? _mm512_maskz_loadu_ps(mask, x + (m0 + i) * D + d) : _mm512_setzero_ps();
          for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(xv[i], ev[j], acc[i][j]);
        }
        for (int i = 0; i < nm; ++i)
          for (int j = 0; j < nv; ++j) y[(m0 + i) * V + v + j] = _mm512_reduce_add_ps(acc[i][j]);
      }
    }
  }
}
"""


def build(tmp: str) -> ctypes.CDLL:
  if shutil.which("g++") is None:
    raise SystemExit("handwritten_gemv.py needs g++")
  with open("/proc/cpuinfo") as f:
    if " avx512f" not in f.read():
      raise SystemExit("handwritten_gemv.py needs a CPU with AVX-512 (avx512f in /proc/cpuinfo)")
  src, lib = os.path.join(tmp, "gemv.cc"), os.path.join(tmp, "libgemv.so")
  with open(src, "w") as f:
    f.write(KERNEL)
  subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", src, "-o", lib], check=True)
  dll = ctypes.CDLL(lib)
  for fn in (dll.matmul, dll.matmul_transposed):
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
  return dll


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=7)
  args = ap.parse_args()
  c = SMOLLM2_135M
  L, D, F, V, M = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size, 8
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  shapes = [(D, q), (D, kv), (D, kv), (q, D), (D, F), (D, F), (F, D)]
  rng = np.random.default_rng(0)
  layers = [[rng.standard_normal(s, dtype=np.float32) for s in shapes] for _ in range(L)]
  head = rng.standard_normal((V, D), dtype=np.float32)
  nbytes = sum(w.nbytes for ws in layers for w in ws) + head.nbytes
  xs = {k: rng.standard_normal((M, k), dtype=np.float32) for k in (D, F)}
  ys = {n: np.empty((M, n), np.float32) for n in (q, kv, D, F, V)}
  ptr = lambda a: a.ctypes.data

  with tempfile.TemporaryDirectory() as tmp:
    dll = build(tmp)
    for K, N in [(D, F), (F, D), (D, kv), (37, 53)]:  # against numpy, ragged tails included
      w = rng.standard_normal((K, N), dtype=np.float32)
      for m in (1, 5, 8):
        x, y = np.ascontiguousarray(rng.standard_normal((m, K), dtype=np.float32)), np.empty((m, N), np.float32)
        dll.matmul(ptr(x), ptr(w), ptr(y), m, K, N)
        np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-3)
    y = np.empty((M, 1001), np.float32)
    dll.matmul_transposed(ptr(xs[D]), ptr(head[:1001]), ptr(y), M, D, 1001)
    np.testing.assert_allclose(y, xs[D] @ head[:1001].T, rtol=1e-4, atol=1e-3)

    def ours():
      for ws in layers:
        for w in ws:
          dll.matmul(ptr(xs[w.shape[0]]), ptr(w), ptr(ys[w.shape[1]]), M, *w.shape)
      dll.matmul_transposed(ptr(xs[D]), ptr(head), ptr(ys[V]), M, D, V)

    def numpy_dots():
      for ws in layers:
        for w in ws:
          np.matmul(xs[w.shape[0]], w, out=ys[w.shape[1]])
      np.matmul(xs[D], head.T, out=ys[V])

    # The step's multiply-adds with no memory stream: one L2-resident [576, 1536] matrix, called as
    # often as the step's weights are bytes. Bounds what any kernel of this shape can reach here.
    hot = layers[0][4]
    calls = round(nbytes / hot.nbytes)

    def cache_resident():
      for _ in range(calls):
        dll.matmul(ptr(xs[D]), ptr(hot), ptr(ys[F]), M, D, F)

    rows = []
    for _ in range(2):  # two rounds, alternating, since this machine's speed drifts
      ours()
      rows.append(dots_row("hand-written AVX-512 kernel (OpenMP)", *best_and_median(ours, args.reps), nbytes))
      rows.append(dots_row("XLA:CPU dots (layer scan)", *xla_dots(args.reps)[:2], nbytes))
      numpy_dots()
      rows.append(dots_row("numpy (OpenBLAS)", *best_and_median(numpy_dots, args.reps), nbytes))
    cache_resident()
    rows.append(dots_row("hand-written kernel, weights cache-resident (same multiply-adds)",
                         *best_and_median(cache_resident, args.reps), nbytes))
  print(f"Command: `{command_line()}`\n")
  print(f"{machine_info()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'all')}\n")
  print("One SmolLM2-135M decode step's dots (30 layers' seven projections + tied LM head), batch 8, "
        f"fp32, {nbytes / 1e6:.0f} MB of weights; two alternating rounds:\n")
  print(table(["dots of one decode step", "best", "median"], rows))


if __name__ == "__main__":
  main()
