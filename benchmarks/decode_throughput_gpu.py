"""Decode throughput of our sampler vs transformers `generate` on one accelerator (or CPU), side by side.

The GPU counterpart of `decode_throughput.py`: the same protocol (batch 8, equal-length prompts,
exactly `--new` new tokens per row with stop tokens disabled on both sides, greedy and T=1, alternating
reps, medians), on model shapes from SmolLM2-135M up to Qwen2.5-7B. The weights are random (the
embedded GGUF is too large to carry to a lent machine) but identical on both sides: transformers
initialises the model on the device, saves it as safetensors, and our loader reads that directory.
Decode speed does not depend on weight values, since no row can stop early.

  JAX_PLATFORMS=cuda python benchmarks/decode_throughput_gpu.py --device=cuda \
      [--models smollm2-135m:float32,qwen2.5-1.5b:bfloat16] [--batch 8] [--new 128] [--reps 3]
  JAX_PLATFORMS=cpu python benchmarks/decode_throughput_gpu.py --device=cpu --models tiny:float32

Run one framework at a time on the GPU's memory: JAX is told not to preallocate, so both fit.
Unlike `decode_throughput.py`, torch runs in this process, so it needs one Python with jax and
torch (CUDA); the project's .venv has no torch (jax 0.12 needs Python 3.12, the torch wheel we use
is for 3.11), so there it exits with a one-line error.
"""
from __future__ import annotations

import argparse
import os
import tempfile


def parse_args():
  ap = argparse.ArgumentParser()
  ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="torch device")
  ap.add_argument("--models", default="smollm2-135m:float32,smollm2-135m:bfloat16,qwen2.5-1.5b:bfloat16,"
                  "qwen2.5-7b:bfloat16", help="comma list of SHAPE:DTYPE (shapes: tiny, smollm2-135m, "
                  "the qwen2.5 presets)")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per row (random ids)")
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--reps", type=int, default=3)
  return ap.parse_args()


os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

import _common  # noqa: E402,F401  (keeps JAX_PLATFORMS if the caller set it)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _common import command_line, median, table, timed, torch_here  # noqa: E402
from decode_throughput import Ours, agreement  # noqa: E402
from model_shapes import shape_config  # noqa: E402
from rlver_jax.models.presets import Qwen2Config, to_hf_config  # noqa: E402


class HF:
  """transformers generate on a model in this process on `device`, EOS disabled so every row produces
  `new` tokens; on a GPU the clock stops only after the device has finished."""

  def __init__(self, model, device: str, new: int):
    import torch
    self.torch, self.model, self.device, self.new = torch, model, device, new

  def _sync(self):
    if self.device == "cuda":
      self.torch.cuda.synchronize()

  def _generate(self, ids, kwargs):
    with self.torch.inference_mode():
      out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=self.new,
                                min_new_tokens=self.new, eos_token_id=None, pad_token_id=0, **kwargs)
    self._sync()
    return out

  def generate(self, prompts: np.ndarray, temperature: float, seed: int):
    torch = self.torch
    ids = torch.from_numpy(prompts.astype(np.int64)).to(self.device)
    kwargs = dict(do_sample=False) if temperature == 0 else dict(
        do_sample=True, temperature=temperature, top_k=0)
    torch.manual_seed(seed)
    self._sync()
    out, t = timed(self._generate, ids, kwargs)
    gen = out[:, prompts.shape[1]:].cpu().numpy()
    assert gen.shape[1] == self.new, gen.shape
    return gen, t


def save_random_checkpoint(config: Qwen2Config, dtype: str, device: str, out_dir: str):
  """Random transformers model of this shape on `device`, saved to `out_dir`; returns the model."""
  import torch
  from transformers import AutoConfig, AutoModelForCausalLM
  hf = dict(to_hf_config(config))
  hf.pop("architectures", None)
  hf_config = AutoConfig.for_model(hf.pop("model_type"), **hf)
  torch.manual_seed(0)
  with torch.device(device):
    model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype)).eval()
  model.save_pretrained(out_dir)
  return model


def bench_one(shape: str, dtype: str, args) -> list:
  import torch
  config = shape_config(shape)
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, config.vocab_size - 1, size=(args.batch, args.prompt)).astype(np.int32)
  n_tok = args.batch * args.new
  with tempfile.TemporaryDirectory() as tmp:
    hf_model = save_random_checkpoint(config, dtype, args.device, tmp)
    ours = Ours(tmp, getattr(jnp, dtype), args.prompt + 1, args.new, pad_id=0)
  hf = HF(hf_model, args.device, args.new)

  _, t_pre0, t_dec0 = ours.generate(prompts, 0.0, 0)
  first_ours = t_pre0 + t_dec0
  _, first_hf = hf.generate(prompts, 0.0, 0)
  res = {(m, s): [] for m in ("greedy", "T=1") for s in ("ours", "hf")}
  greedy = {}
  for rep in range(args.reps):
    for m, temp in (("greedy", 0.0), ("T=1", 1.0)):
      toks, a, b = ours.generate(prompts, temp, rep + 1)
      res[(m, "ours")].append(a + b)
      hf_toks, t = hf.generate(prompts, temp, rep + 1)
      res[(m, "hf")].append(t)
      if temp == 0:
        greedy = {"ours": toks, "hf": hf_toks}
      print(f"{shape} {dtype} rep {rep} {m}: ours {n_tok / (a + b):.0f} tok/s, "
            f"transformers {n_tok / t:.0f} tok/s", flush=True)
  lo, mean = agreement(greedy["ours"], greedy["hf"])
  rows = []
  for m in ("greedy", "T=1"):
    o, h = median(res[(m, "ours")]), median(res[(m, "hf")])
    rows.append([shape, dtype, m, f"{n_tok / o:,.0f}", f"{n_tok / h:,.0f}", f"{h / o:.1f}x",
                 f"{first_ours:.1f}", f"{lo} / {mean:.0f}"])
  del ours, hf, hf_model
  if args.device == "cuda":
    torch.cuda.empty_cache()
  jax.clear_caches()
  return rows


def main():
  args = parse_args()
  torch = torch_here()  # a CUDA model is timed in this process (no worker: one device, one process)
  import transformers
  rows = []
  for item in args.models.split(","):
    shape, _, dtype = item.partition(":")
    rows += bench_one(shape, dtype or "bfloat16", args)
    print("\n".join(" | ".join(map(str, r)) for r in rows[-2:]), flush=True)  # partial results first
  dev = (torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu")
  print()
  print(f"Command: `{command_line()}`\n")
  print(f"Machine: {dev}, jax={jax.__version__} ({jax.devices()[0].platform}), torch={torch.__version__}, "
        f"transformers={transformers.__version__}\n")
  print(f"Batch {args.batch}, prompt {args.prompt} random tokens, {args.new} new tokens per row, same random "
        f"weights and dtype on both sides, {args.reps} alternating reps, medians; ours = prefill + decode.\n")
  print(table(["shape", "dtype", "mode", "ours tok/s", "transformers tok/s", "ours / transformers",
               "our first call s (compile)", "greedy common prefix min / mean"], rows))


if __name__ == "__main__":
  main()
