"""Decode throughput of our sampler (prefill + while-loop decode) vs transformers `generate` on CPU.

Same SmolLM2-135M-Instruct weights (the embedded HF directory) on both sides, fp32, batch 8, chat
prompts of equal length, exactly `--new` new tokens per row (no stop tokens on either side), greedy,
temperature-1 sampling and the simulator's T=0.7 / top-p 0.9. Runs alternate ours / transformers, `--reps` times; medians are reported.
transformers runs in the parity tests' torch worker under .venv-torch (`make install-torch`; jax
0.12 needs Python 3.12, the CPU torch wheel is for 3.11): the worker loads the model, sets
`--threads` and OMP_WAIT_POLICY=PASSIVE, and times `generate` itself, so the pipe is not timed.
`--peers transformers,tunix` adds google-tunix's JAX sampler on the same weights and prompt ids to
every rep (`tunix_peer.py`; needs `make bench-tunix-env` and its `.venv-tunix/bin/python`); tunix
compiles once per temperature, so each mode is warmed up on every side before the timed reps.

  cd benchmarks && ../.venv/bin/python decode_throughput.py [--batch 8] [--new 128] [--reps 3] [--no-bf16]
  ../.venv-tunix/bin/python decode_throughput.py --peers transformers,tunix --no-bf16 --no-probe
"""
from __future__ import annotations

import argparse
import os

import _common  # noqa: F401  (sets JAX_PLATFORMS=cpu before jax is imported)
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _common import CompileCounter, command_line, machine_info, median, table, timed, torch_reference
from rlver_jax.models import load_pretrained
from rlver_jax.models.embedded import embedded_model_dir
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams

USER_TEXTS = [
    "I have been feeling overwhelmed at work lately and I do not know who to talk to about it.",
    "My sister and I had a huge argument last weekend and now she will not answer my calls at all.",
    "I failed my driving test for the third time today and I feel like giving up on it entirely.",
    "Lately I cannot sleep more than four hours a night because my mind keeps racing about money.",
    "My best friend is moving to another country next month and I am scared of feeling lonely.",
    "I got passed over for a promotion again, and my manager gave it to someone who joined last year.",
    "My dog is getting old and the vet says he might not have much time left with us anymore.",
    "I moved to a new city for university and I still have not made a single friend after months.",
]
SYSTEM = "You are a warm, empathetic listener. Reply briefly and kindly."


def make_prompts(chat: ChatTokens, batch: int, content_len: int) -> np.ndarray:
  """[batch, P] chat prompts (system + user + assistant header), user contents cut to equal length."""
  rows = []
  for i in range(batch):
    text = " ".join(USER_TEXTS[(i + j) % len(USER_TEXTS)] for j in range(4))
    content = chat.encode(text)[:content_len]
    rows.append(chat.message("system", SYSTEM) + [chat.im_start] + chat.encode("user\n") + content
                + [chat.im_end] + chat.encode("\n") + chat.generation_header())
  return np.array(rows, np.int32)


class Ours:
  """Our sampler with no stop ids, so every row decodes exactly `new` tokens."""

  def __init__(self, path: str, dtype, prompt_len: int, new: int, pad_id: int):
    self.model, _ = load_pretrained(path, dtype=dtype)
    self.params = nnx.state(self.model)
    self.new = new
    self.sampler = Sampler(self.model, max_len=prompt_len + new, stop_ids=[-1], pad_id=pad_id)
    self.cache = None

  def prefill(self, prompts: np.ndarray):
    """Prefill alone (waits for the result); keeps the cache for the next call."""
    if self.cache is None:
      self.cache = self.sampler.init_cache(prompts.shape[0])
    cache, logits = self.sampler.prefill(self.params, self.cache, prompts.tolist())
    self.cache = jax.block_until_ready(cache)
    return cache, jax.block_until_ready(logits)

  def generate(self, prompts: np.ndarray, temperature: float, seed: int, top_p: float = 1.0):
    """Returns (tokens [B, new], prefill seconds, decode seconds)."""
    (cache, logits), t_pre = timed(self.prefill, prompts)
    res, t_dec = timed(self.sampler.decode, self.params, cache, logits, rng=jax.random.key(seed),
                       max_new_tokens=self.new, sampling=SamplingParams.make(temperature, top_p=top_p))
    self.cache = res.cache
    assert (res.num_tokens == self.new).all(), res.num_tokens
    return res.tokens, t_pre, t_dec


class HF:
  """transformers `generate` in the .venv-torch worker (`_common.torch_reference`), fp32, EOS disabled
  so every row produces `new` tokens; timed inside the worker, so the pipe is not timed."""

  def __init__(self, path: str, new: int, threads: int, omp_wait_policy: str | None = "PASSIVE"):
    ref = torch_reference(OMP_WAIT_POLICY=omp_wait_policy)
    ref.worker().request("torch_threads", threads)
    self.model, self.new = ref.from_pretrained(path, dtype="float32"), new

  def generate(self, prompts: np.ndarray, temperature: float, seed: int, new: int | None = None,
               top_p: float = 1.0):
    new = new or self.new
    kwargs = dict(do_sample=False) if temperature == 0 else dict(
        do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    gen, t = self.model.timed_generate(prompts, new, seed, **kwargs)
    assert gen.shape[1] == new, gen.shape
    return gen, t


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
  """(min over rows of the common greedy prefix length, mean of it)."""
  same = np.cumprod(a == b, axis=1).sum(axis=1)
  return int(same.min()), float(same.mean())


def prefill_probe(ours: Ours, hf: HF, chat: ChatTokens, batch: int, content: int, reps: int):
  """Prefill seconds at a prompt length on a bucket edge and one past it (ours) vs transformers."""
  rows = []
  for c in (content, content + 1):
    prompts = make_prompts(chat, batch, c)
    ours.prefill(prompts)  # compiles this bucket once
    t_ours, t_hf = [], []
    for _ in range(reps):
      t_ours.append(timed(ours.prefill, prompts)[1])
      t_hf.append(hf.generate(prompts, 0.0, 0, new=1)[1])
    P = prompts.shape[1]
    T = min(b for b in ours.sampler.append_buckets if b >= P)
    rows.append([P, T, f"{median(t_ours):.2f}", f"{median(t_hf):.2f}", f"{median(t_hf) / median(t_ours):.2f}x"])
  return table(["prompt tokens", "our append bucket", "ours prefill s", "transformers generate(1 token) s",
                "transformers / ours"], rows)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--content", type=int, default=36,
                  help="user-message tokens per prompt (36: a 64-token prompt, exactly an append bucket)")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--omp-active", action="store_true",
                  help="the torch worker keeps OpenMP's default spin-wait (pathological on an oversubscribed machine)")
  ap.add_argument("--no-bf16", dest="bf16", action="store_false")
  ap.add_argument("--no-probe", dest="probe", action="store_false")
  ap.add_argument("--peers", default="transformers",
                  help="comma-separated peers timed in every rep: transformers (always), tunix")
  args = ap.parse_args()
  peers = set(args.peers.split(",")) | {"transformers"}
  if peers - {"transformers", "tunix"}:
    raise SystemExit(f"--peers: unknown peer(s) {sorted(peers - {'transformers', 'tunix'})}")
  if not args.omp_active:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when the worker's OpenMP starts

  path = embedded_model_dir()
  chat = ChatTokens(load_tokenizer(path))
  prompts = make_prompts(chat, args.batch, args.content)
  B, P = prompts.shape
  n_tok = B * args.new
  counter = CompileCounter()

  ours = Ours(path, jnp.float32, P + 1, args.new, chat.pad_id)
  hf = HF(path, args.new, args.threads, os.environ.get("OMP_WAIT_POLICY"))

  # Warm-up: our first call compiles (prefill + decode programs); transformers' first call warms caches.
  counter.reset()
  _, t_pre0, t_dec0 = ours.generate(prompts, 0.0, 0)
  compiles, compile_s = counter.snapshot()
  _, first_hf = hf.generate(prompts, 0.0, 0)

  # (temperature, top_p); the last is the simulator's default sampling (configs/base.py).
  modes = {"greedy": (0.0, 1.0), "T=1.0": (1.0, 1.0), "T=0.7 top_p=0.9": (0.7, 0.9)}
  tx, tx_first = None, {}
  if "tunix" in peers:
    from tunix_peer import Tunix
    tx = Tunix(path, prompts, args.new)
    for m, (temp, top_p) in modes.items():  # compiles per temperature; ours compiled once above
      tx_first[m] = tx.generate(prompts, temp, 0, top_p)[1]
  for temp, top_p in modes.values():  # our sampling variants run once before the timed reps too
    ours.generate(prompts, temp, 0, top_p)
  counter.reset()
  res = {(m, side): [] for m in modes for side in ("ours", "ours_decode", "hf", "tunix")}
  greedy = {}
  for rep in range(args.reps):
    for m, (temp, top_p) in modes.items():
      toks, t_pre, t_dec = ours.generate(prompts, temp, rep, top_p)
      res[(m, "ours")].append(t_pre + t_dec)
      res[(m, "ours_decode")].append(t_dec)
      hf_toks, t_hf = hf.generate(prompts, temp, rep, top_p=top_p)
      res[(m, "hf")].append(t_hf)
      tx_note = ""
      if tx:
        tx_toks, t_tx = tx.generate(prompts, temp, rep, top_p)
        res[(m, "tunix")].append(t_tx)
        tx_note = f", tunix {n_tok / t_tx:.1f} tok/s"
      if temp == 0:
        greedy = {"ours": toks, "hf": hf_toks, "tunix": tx_toks if tx else None}
      print(f"rep {rep} {m}: ours {n_tok / (t_pre + t_dec):.1f} tok/s (decode only "
            f"{n_tok / t_dec:.1f}), transformers {n_tok / t_hf:.1f} tok/s{tx_note}", flush=True)
  recompiles = counter.snapshot()[0]

  probe = prefill_probe(ours, hf, chat, B, args.content, 2) if args.probe else None

  bf16 = {}
  if args.bf16:
    del ours
    ours16 = Ours(path, jnp.bfloat16, P + 1, args.new, chat.pad_id)
    counter.reset()
    _, a, b = ours16.generate(prompts, 0.0, 0)
    bf16["first"], bf16["compile_s"] = a + b, counter.snapshot()[1]
    for m, (temp, top_p) in modes.items():
      _, a, b = ours16.generate(prompts, temp, 1, top_p)
      bf16[m] = a + b
      _, bf16["hf_" + m] = hf.generate(prompts, temp, 1, top_p=top_p)

  print()
  print(f"Command: `{command_line()}`\n")
  print(machine_info(with_torch=True) + f", worker OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}\n")
  print(f"Batch {B}, prompt {P} tokens, {args.new} new tokens per row ({n_tok} per call), fp32 on both "
        f"sides, {args.reps} alternating reps, medians. torch threads={args.threads}.\n")
  rows = []
  for m in modes:
    o, od, h = (median(res[(m, s)]) for s in ("ours", "ours_decode", "hf"))
    rows.append([m, f"{n_tok / o:.1f}", f"{n_tok / od:.1f}", f"{n_tok / h:.1f}", f"{h / o:.2f}x",
                 f"{o:.2f}", f"{h:.2f}"])
  print(table(["mode", "ours tok/s (prefill+decode)", "ours tok/s (decode only)",
               "transformers tok/s", "ours / transformers", "ours s", "transformers s"], rows))
  if tx:
    print()
    print(table(["mode", "ours tok/s (prefill+decode)", "tunix tok/s (prefill+decode)", "ours / tunix",
                 "tunix first call s (compile + run)"],
                [[m, f"{n_tok / median(res[(m, 'ours')]):.1f}", f"{n_tok / median(res[(m, 'tunix')]):.1f}",
                  f"{median(res[(m, 'tunix')]) / median(res[(m, 'ours')]):.2f}x", f"{tx_first[m]:.2f}"]
                 for m in modes]))
    lo_t, mean_t = agreement(greedy["ours"], greedy["tunix"])
    print(f"\ngreedy common prefix ours vs tunix (min / mean over rows): {lo_t} / {mean_t:.1f} of {args.new}")
  print()
  lo, mean = agreement(greedy["ours"], greedy["hf"])
  print(table(["item", "value"], [
      ["our first call (compile + run), s", f"{t_pre0 + t_dec0:.2f}"],
      ["XLA compiles in our first call / their backend compile s", f"{compiles} / {compile_s:.2f}"],
      ["XLA compiles during the timed reps (expect 0)", recompiles],
      ["transformers first call, s", f"{first_hf:.2f}"],
      ["greedy common prefix ours vs transformers (min / mean over rows)",
       f"{lo} / {mean:.1f} of {args.new}"],
  ]))
  if probe:
    print()
    print(probe)
  if bf16:
    print()
    print(f"bf16 (ours: params, compute and cache bf16; one run each after a warm-up, next to one "
          f"fp32 transformers run; first call {bf16['first']:.2f} s incl. {bf16['compile_s']:.2f} s "
          f"compile):\n")
    print(table(["mode", "ours bf16 tok/s", "transformers fp32 tok/s (same moment)", "ratio"],
                [[m, f"{n_tok / bf16[m]:.1f}", f"{n_tok / bf16['hf_' + m]:.1f}",
                  f"{bf16['hf_' + m] / bf16[m]:.2f}x"] for m in modes]))


if __name__ == "__main__":
  main()
