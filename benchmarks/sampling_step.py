"""One sampling step alone: our `sample` (filters, draw, both log-probs) against transformers'
logits processors + torch.multinomial on the same logits, per sampling setting; optionally against
another checkout's `strategies.py` in the same run (`--baseline`). Also how many tokens the embedded
model's top-p nuclei hold while it generates (the filters cut small nuclei from 64 candidates).

The logits are the embedded model's own next-token logits at a batch of chat prompts (peaked the way
real ones are), tiled to the vocabulary width asked for. torch runs in this process beside jax (the
step is timed interleaved with ours), so it needs one Python with both; the project's .venv has no
torch (jax 0.12 needs Python 3.12, the CPU torch wheel is for 3.11), so there it exits with a
one-line error. Run from benchmarks/:

  python sampling_step.py [--batch 8] [--vocab 49152,151936] [--reps 50]
      [--baseline OTHER_CHECKOUT/rlver_jax/sampling/strategies.py]
"""
from __future__ import annotations

import argparse
import importlib.util

import _common  # noqa: F401  (sets JAX_PLATFORMS before jax is imported)
from _common import command_line, machine_info, median, table, timed, torch_here

import jax
import numpy as np

from rlver_jax.sampling.strategies import SamplingParams, sample

# (temperature, top_p, top_k): greedy; plain T=1 (training); the simulator's; the evaluation's.
SETTINGS = {"greedy": (0.0, 1.0, 0), "T=1": (1.0, 1.0, 0), "T=0.7 top_p=0.9": (0.7, 0.9, 0),
            "T=0.7 top_p=0.8 top_k=20": (0.7, 0.8, 20)}


def load_model_and_prompts(batch: int):
  """The embedded model (transformers, fp32) and a left-padded batch of chat prompts."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  from rlver_jax.models.embedded import embedded_model_dir
  path = embedded_model_dir()
  tok = AutoTokenizer.from_pretrained(path)
  model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  topics = ["work", "family", "sleep", "money", "a friend", "exams", "moving", "health"]
  texts = [tok.apply_chat_template([{"role": "user", "content": f"I feel low about {topics[i % 8]}."}],
                                   add_generation_prompt=True, tokenize=False) for i in range(batch)]
  tok.padding_side = "left"
  return model, tok(texts, return_tensors="pt", padding=True)


def model_logits(model, enc) -> np.ndarray:
  """[batch, 49152] next-token logits after the prompts."""
  import torch
  with torch.inference_mode():
    return model(**enc).logits[:, -1].float().numpy()


def nucleus_sizes(model, enc, temperature: float, top_p: float, new: int) -> np.ndarray:
  """[steps * batch] tokens in each step's nucleus while the model samples `new` tokens per row."""
  import torch
  torch.manual_seed(0)
  with torch.inference_mode():
    out = model.generate(**enc, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                         max_new_tokens=new, output_logits=True, return_dict_in_generate=True)
  sizes = []
  for step in out.logits:
    p, _ = torch.sort(torch.softmax(step.float() / temperature, -1), -1, descending=True)
    sizes.append(((torch.cumsum(p, -1) - p) < top_p).sum(-1).numpy())
  return np.concatenate(sizes)


def load_strategies(path: str):
  """Another checkout's rlver_jax/sampling/strategies.py as a module (its own imports resolve to
  this checkout's package)."""
  spec = importlib.util.spec_from_file_location("baseline_strategies", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def widen(logits: np.ndarray, vocab: int) -> np.ndarray:
  """Tiles a row to `vocab` entries; the copies sit 8 nats lower so the original keeps its shape."""
  reps = -(-vocab // logits.shape[1])
  tiles = [logits - 8.0 * (i > 0) for i in range(reps)]
  return np.concatenate(tiles, axis=1)[:, :vocab].astype(np.float32)


def torch_sampler(temperature: float, top_p: float, top_k: int):
  import torch
  from transformers import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                            TopPLogitsWarper)
  procs = LogitsProcessorList()
  if temperature > 0:
    procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
      procs.append(TopKLogitsWarper(top_k))
    if top_p < 1:
      procs.append(TopPLogitsWarper(top_p))

  def step(logits):
    with torch.inference_mode():
      if temperature == 0:
        return torch.argmax(logits, dim=-1)
      scores = procs(None, logits)
      return torch.multinomial(torch.softmax(scores, dim=-1), 1)[:, 0]
  return step


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--vocab", default="49152,151936")
  ap.add_argument("--reps", type=int, default=50)
  ap.add_argument("--baseline", default="", help="another checkout's strategies.py to time too")
  ap.add_argument("--nucleus-new", type=int, default=128,
                  help="tokens per row generated to measure nucleus sizes (0: skip)")
  args = ap.parse_args()
  torch = torch_here()
  torch.set_num_threads(2)
  model, enc = load_model_and_prompts(args.batch)
  base = model_logits(model, enc)
  ours = jax.jit(sample)
  other = None
  if args.baseline:
    mod = load_strategies(args.baseline)
    other = (jax.jit(mod.sample), mod.SamplingParams)
  rows = []
  for V in (int(v) for v in args.vocab.split(",")):
    logits = widen(base, V)
    x, xt = jax.device_put(logits), torch.from_numpy(logits)
    for name, (t, p, k) in SETTINGS.items():
      params, key = SamplingParams.make(t, p, k), jax.random.key(0)
      jax.block_until_ready(ours(x, key, params))
      step = torch_sampler(t, p, k)
      step(xt)
      a, b, c = [], [], []
      if other:
        other_params = other[1].make(t, p, k)
        jax.block_until_ready(other[0](x, key, other_params))
      for _ in range(args.reps):  # interleaved, so a slow moment hits every side alike
        a.append(timed(lambda: jax.block_until_ready(ours(x, key, params)))[1])
        b.append(timed(step, xt)[1])
        if other:
          c.append(timed(lambda: jax.block_until_ready(other[0](x, key, other_params)))[1])
      rows.append([f"{args.batch} x {V}", name, f"{median(a) * 1e3:.2f}", f"{median(b) * 1e3:.2f}",
                   f"{median(b) / median(a):.1f}x"]
                  + ([f"{median(c) * 1e3:.2f}", f"{median(c) / median(a):.1f}x"] if other else []))
      print(rows[-1], flush=True)
  print(f"\nCommand: `{command_line()}`\n")
  print(machine_info() + f", torch={torch.__version__} (in this process)\n")
  print(f"Medians of {args.reps} calls. Ours: `sample` jitted (filters, draw, sampled and raw log-probs); "
        "transformers: its temperature/top-k/top-p warpers, softmax and torch.multinomial (argmax "
        "for greedy), torch threads=2.\n")
  print(table(["logits", "setting", "ours ms", "transformers ms", "transformers / ours"]
              + (["baseline ms", "baseline / ours"] if other else []), rows))
  if other:
    print(f"\nbaseline: {args.baseline}")
  if args.nucleus_new:
    sizes = nucleus_sizes(model, enc, 0.7, 0.9, args.nucleus_new)
    q = np.percentile(sizes, [50, 90, 99, 100])
    print(f"\nNucleus sizes of the embedded model at T=0.7, top_p=0.9 over {sizes.size} sampled "
          f"row-steps ({args.batch} rows x {args.nucleus_new} tokens): median {q[0]:.0f}, p90 "
          f"{q[1]:.0f}, p99 {q[2]:.0f}, max {q[3]:.0f}; over 63 tokens (bisection): "
          f"{(sizes > 63).mean():.2%}")


if __name__ == "__main__":
  main()
