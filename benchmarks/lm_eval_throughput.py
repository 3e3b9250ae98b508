"""lm-eval throughput: our backend (RlverLM: our model + KV-cached sampler) vs lm-eval's `hf` backend.

Same embedded SmolLM2-135M-Instruct weights (fp32) on both sides, the same lm-eval tasks through
`simple_evaluate` with the chat template: `rlver_tiny_mc` (8 questions x 4 choices, log-likelihood)
and `rlver_tiny_gen` (8 greedy generations of up to 16 tokens, cut at a newline). One untimed first
pass per side (compilation, warm-up), then `--reps` passes alternating ours / hf; medians.
Samples/s counts task samples (documents), lm-eval's own overhead included on both sides.

  python benchmarks/lm_eval_throughput.py [--reps 3] [--batch 8]

lm-eval's hf backend runs in this process, so it needs one Python with jax and torch; the project's
.venv has no torch (jax 0.12 needs Python 3.12, the CPU torch wheel is for 3.11) and exits with a
one-line error (`tests/evaluation/test_lm_eval_parity.py` drives HFLM in the torch worker instead).
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's spinning threads would take both cores
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import _common  # noqa: E402,F401  (sets JAX_PLATFORMS=cpu before jax is imported)
import jax.numpy as jnp  # noqa: E402

from _common import command_line, machine_info, median, table, timed, torch_here  # noqa: E402
from rlver_jax.evaluation import general as general_eval  # noqa: E402
from rlver_jax.evaluation.lm_eval_backend import RlverLM  # noqa: E402
from rlver_jax.models import load_pretrained  # noqa: E402
from rlver_jax.models.embedded import embedded_model_dir  # noqa: E402
from rlver_jax.models.tokenizer import load_tokenizer  # noqa: E402

TASKS = {"rlver_tiny_mc": ("loglikelihood", "acc,none"),
         "rlver_tiny_gen": ("generate_until", "exact_match,first_word")}


def run(lm, task: str) -> tuple[dict, float]:
  return timed(general_eval.evaluate, lm, [task], apply_chat_template=True, bootstrap_iters=0)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--batch", type=int, default=8)
  args = parser.parse_args()
  torch = torch_here()  # lm-eval's hf backend runs in this process
  from lm_eval.models.huggingface import HFLM

  path = embedded_model_dir()
  model, _ = load_pretrained(path, dtype=jnp.float32)
  sides = {"ours": RlverLM(model, load_tokenizer(path), batch_size=args.batch, max_length=512,
                           checkpoint_dir=path),
           "hf": HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=args.batch,
                      max_length=512)}
  rows = []
  for task, (kind, metric) in TASKS.items():
    first, times, scores = {}, {s: [] for s in sides}, {}
    for side, lm in sides.items():
      res, first[side] = run(lm, task)
      scores[side] = res["results"][task][metric]
      n = res["n-samples"][task]["effective"]
    for _ in range(args.reps):
      for side, lm in sides.items():
        times[side].append(run(lm, task)[1])
    ours, hf = (n / median(times[s]) for s in ("ours", "hf"))
    rows.append([task, kind, n, ours, hf, f"{ours / hf:.2f}x", f"{first['ours']:.1f} / {first['hf']:.1f}",
                 f"{scores['ours']:.3f} / {scores['hf']:.3f}"])
  print(machine_info() + f", torch={torch.__version__} (in this process)")
  print(command_line())
  print(table(["task", "requests", "samples", "ours samples/s", "hf samples/s", "ratio",
               "first pass s (ours / hf)", "metric (ours / hf)"], rows))


if __name__ == "__main__":
  main()
