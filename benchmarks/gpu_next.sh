#!/usr/bin/env bash
# What a lent GPU should measure next, as one device call (the device budget is ~15 minutes):
# static slices of the stacked weights read in place (5.6 ms per 7B step) but the sampler with them
# did not gain (11.2 ms); first whether an on-device loop (the sampler's while_loop) brings the copies
# back, then the profile that counts the sampler's memcpys.
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

LIMIT=${WHILE_LIMIT:-420} step while_loop "$PYTHON" decode_in_while_loop.py \
  --model "$MODEL" --window "$WINDOW" --reps 3 --tokens 16
step profile "$PYTHON" decode_profile.py --model "$MODEL" --new 32 --top 30
