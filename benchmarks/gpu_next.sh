#!/usr/bin/env bash
# What a lent GPU should measure next, as one device call (the device budget is ~15 minutes):
# whether XLA:GPU's per-layer weight-slice copies in the layer scan are what holds 7B decode at ~35%
# of HBM bandwidth (session 5), and whether dynamic-slice fusion or per-layer buffers remove them.
#   run from the repository root:  OUT=/some/dir bash benchmarks/gpu_next.sh
# Each step has its own time limit and keeps going on failure (an XLA flag unknown to the installed
# jaxlib aborts only its own step). Logs go to $OUT (default /tmp/gpu_next).
# MODEL / WINDOW / LIMIT / PYTHON override the defaults
# (a CPU smoke run: JAX_PLATFORMS=cpu MODEL=tiny:float32 PYTHON=.venv/bin/python).
set -u
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
MODEL=${MODEL:-qwen2.5-7b:bfloat16}
WINDOW=${WINDOW:-1024}
LIMIT=${LIMIT:-150}
OUT=${OUT:-/tmp/gpu_next}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
case $PYTHON in */*) PYTHON=$(realpath -s "$PYTHON") ;; esac  # -s: a venv's python is a symlink
cd "$(dirname "$0")"
export PYTHONPATH="$(cd .. && pwd)${PYTHONPATH:+:$PYTHONPATH}"  # rlver_jax without an install

step() {  # step NAME COMMAND...: run with a time limit, log to $OUT/NAME.txt, report the exit status
  local name=$1; shift
  timeout "$LIMIT" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: exit $? ($(tail -n 1 "$OUT/$name.txt" | cut -c1-100))"
}

step floor "$PYTHON" investigations/decode_step_floor.py --models "$MODEL" --reps 3 --read-gib 1
step scan_vs_loop "$PYTHON" investigations/layer_scan_vs_loop.py --model "$MODEL" --window "$WINDOW" --reps 10
step scan_vs_loop_dsf env XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true \
  "$PYTHON" investigations/layer_scan_vs_loop.py --model "$MODEL" --window "$WINDOW" --reps 10
step profile "$PYTHON" decode_profile.py --model "$MODEL" --new 32 --top 30
