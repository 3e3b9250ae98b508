"""Fidelity of the int8 simulator (config simulator.weight_dtype / kv_dtype) against bf16.

1. Next-token distributions over a fixed text set (the simulator's own prompts for every demo
   profile: persona, background, opening instruction, a reply and the emotion instruction), teacher-
   forced through the KV-cached path: per-token KL(bf16 || int8) and top-1 agreement, for int8
   weights, int8 KV and both.
2. 50 fixed simulator turns (5 demo profiles x 10 fixed policy replies, each after the profile's
   greedy opening): the emotion step decoded greedily and its change line parsed; and, since a small
   model rarely writes one, the change the model gives at a forced "Change: " (the argmax value and
   the mean over -10..+10, scored like simulator.change_mode="expected"). Per int8 setting: the
   share identical to bf16 and the mean |difference|.

  cd benchmarks && python int8_fidelity.py                       # embedded SmolLM2-135M
  python int8_fidelity.py --checkpoint=HF_DIR                     # any Qwen2-family checkpoint
  python int8_fidelity.py --dtype=float32 --skip_texts            # part 2 at CPU speed (fp32 base)
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import _common  # noqa: F401  (sets JAX_PLATFORMS=cpu before jax is imported)
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _common import command_line, machine_info, table
from rlver_jax import build
from rlver_jax.env import info_flow, simulator_prompts as prompts
from rlver_jax.env.expected_change import ChangeScorer, expected_value
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.sampling.branches import BranchQuery, score_branches
from rlver_jax.spec import SimulatorSpec

SETTINGS = {"bf16": ("bf16", "bf16"), "int8 weights": ("int8", "bf16"), "int8 KV": ("bf16", "int8"),
            "int8 both": ("int8", "int8")}
REPLIES = [
    "That sounds really hard. I'm here, tell me more about what happened.",
    "It makes sense that you feel this way; what would help you most right now?",
    "Honestly, you should just stop worrying so much.",
    "Have you tried making a plan for the next week, one small step a day?",
    "I hear how tired you are. You don't have to solve it all today.",
    "Whatever. Everyone has problems.",
    "What part of this weighs on you the most?",
    "You did your best with what you knew. That counts for a lot.",
    "Maybe talk to someone you trust about it; you don't have to carry it alone.",
    "Let's think about what is in your control here and what is not.",
]


def _spec(args, weight_dtype, kv_dtype) -> SimulatorSpec:
  return SimulatorSpec(checkpoint=args.checkpoint, dtype=args.dtype, max_context=args.max_context,
                       max_new_tokens=args.max_new_tokens, temperature=0.0, max_parse_retries=0,
                       weight_dtype=weight_dtype, kv_dtype=kv_dtype)


# -- 1. next-token distributions over a fixed text set -------------------------------------------


def text_set(chat, n_tokens: int) -> list[list[int]]:
  """Per demo profile: its simulator context up to the emotion step, its last n_tokens."""
  texts = []
  for i, p in enumerate(load_demo_profiles()):
    msgs = [{"role": "system", "content": prompts.system_prompt(p, "vanilla", "en")},
            {"role": "user", "content": prompts.opening_instruction("en", bool(p.first_talk))},
            {"role": "assistant", "content": p.first_talk or "I just don't know what to do anymore."}]
    new, _ = info_flow.emotion_messages("chat", REPLIES[i % len(REPLIES)], 30, "en", "vanilla", False, 10)
    ids = [t for m in msgs + list(new) for t in chat.message(m["role"], m["content"])]
    texts.append(ids[-n_tokens:])  # the end: the opening, the reply and the instruction
  return texts


def all_logprobs(backend, tokens: list[int], T: int) -> np.ndarray:
  """fp32 next-token log-probs [len(tokens), V] of one text (padded to T), every token attending the
  others through the backend's own cache (its KV dtype: an int8 cache's tokens are read as int8)."""
  sampler = backend.sampler
  ids = np.full((1, T), sampler.pad_id, np.int32)
  ids[0, :len(tokens)] = tokens
  if not hasattr(backend, "_all_logprobs"):
    def run(params, cache, ids):
      model = nnx.merge(sampler.graphdef, params)
      hidden, _ = model.cached_hidden_states(ids, jnp.arange(T)[None], cache.view(sampler.windows[0]))
      return jax.nn.log_softmax(model.logits(hidden), axis=-1)
    backend._all_logprobs = jax.jit(run)
  out = backend._all_logprobs(backend.params, sampler.init_cache(1), jnp.asarray(ids))
  return np.asarray(out[0, :len(tokens)])


def distribution_rows(args, backends, chat):
  texts = text_set(chat, args.text_tokens)
  kl, top1 = {n: [] for n in list(SETTINGS)[1:]}, {n: [] for n in list(SETTINGS)[1:]}
  for tokens in texts:
    ref = all_logprobs(backends["bf16"], tokens, args.text_tokens)
    for name in list(SETTINGS)[1:]:
      got = all_logprobs(backends[name], tokens, args.text_tokens)
      kl[name].append((np.exp(ref) * (ref - got)).sum(-1))
      top1[name].append(ref.argmax(-1) == got.argmax(-1))
  if "fp32" in backends:  # the noise floor: bf16 itself against fp32, KL(fp32 || bf16)
    kl["bf16 vs fp32"], top1["bf16 vs fp32"] = [], []
    for tokens in texts:
      ref = all_logprobs(backends["fp32"], tokens, args.text_tokens)
      got = all_logprobs(backends["bf16"], tokens, args.text_tokens)
      kl["bf16 vs fp32"].append((np.exp(ref) * (ref - got)).sum(-1))
      top1["bf16 vs fp32"].append(ref.argmax(-1) == got.argmax(-1))
  rows = []
  for name in [n for n in kl if n != "bf16"]:
    k, t = np.concatenate(kl[name]), np.concatenate(top1[name])
    rows.append([name, len(k), f"{k.mean():.5f}", f"{np.quantile(k, 0.99):.4f}", f"{t.mean():.2%}"])
  return rows


# -- 2. fixed simulator turns -------------------------------------------------------------------


def forced_change(backend, chat, scorer: ChangeScorer, rows: list[int]) -> dict[int, tuple[int, float]]:
  """Per row: (argmax value, mean value) of the change the model writes after a forced "Change:",
  in place of its own emotion answer (the cache is rewound to the answer's start first)."""
  sampler = backend.sampler
  lengths = np.asarray(backend.cache.lengths).copy()
  forced = chat.encode("Change:")
  append = [[] for _ in range(backend.cache.batch_size)]
  queries, values = {}, {}
  for row in rows:
    start = backend.answers[row][0]
    slot = backend._slot(row)
    lengths[slot] = start
    append[slot] = forced
    values[slot], branches = scorer.forms_after(" ")
    queries[slot] = BranchQuery(prefix_len=start + len(forced), root=forced[-1], branches=branches)
  cache = backend.cache.with_lengths(lengths)
  cache, _ = sampler.append(backend.params, cache, append)
  scores = score_branches(sampler, backend.params, cache, queries, extend_ids=scorer.digit_ids())
  out = {}
  for row in rows:
    slot = backend._slot(row)
    per_value = {}
    for v, lp in zip(values[slot], scores[slot]):
      per_value[v] = np.logaddexp(per_value.get(v, -np.inf), lp)
    out[row] = (max(per_value, key=per_value.get), expected_value(per_value))
  return out


def turn_rows(args, chat):
  """Per int8 setting: parsed changes (share read, identical, mean |diff|) and forced ones."""
  out = {}
  for name, (w, kv) in SETTINGS.items():
    backend = build.simulator_backend(_spec(args, w, kv), None, seed=0)
    profiles = load_demo_profiles()[:args.profiles]
    rows = [(p, r) for p in range(args.profiles) for r in range(len(REPLIES))]
    users = SimulatedUsers([profiles[p] for p, _ in rows], backend, groups=[p for p, _ in rows],
                           max_turns=1, max_parse_retries=0)
    t0 = time.perf_counter()
    users.opening()
    live = users.live_rows()
    results = users.step(live, [REPLIES[rows[i][1]] for i in live])
    # max_turns=1: the dialogue ends with the emotion step, so the backend's last answer is it.
    parsed = {r.row: (r.change if r.parsed else None) for r in results}
    forced = forced_change(backend, chat, ChangeScorer(chat), [r.row for r in results])
    out[name] = (parsed, forced, time.perf_counter() - t0)
    print(f"{name}: {len(results)} turns in {out[name][2]:.0f} s", flush=True)
  ref_parsed, ref_forced, _ = out["bf16"]
  table_rows = []
  for name in list(SETTINGS)[1:]:
    parsed, forced, _ = out[name]
    both = [r for r in parsed if parsed[r] is not None and ref_parsed.get(r) is not None]
    same_read = [parsed[r] == ref_parsed.get(r) for r in parsed]  # None == None counts as the same
    diff_read = [abs(parsed[r] - ref_parsed[r]) for r in both]
    arg_same = [forced[r][0] == ref_forced[r][0] for r in forced]
    mean_diff = [abs(forced[r][1] - ref_forced[r][1]) for r in forced]
    table_rows.append([
        name, len(parsed),
        f"{np.mean([v is not None for v in ref_parsed.values()]):.0%} / "
        f"{np.mean([v is not None for v in parsed.values()]):.0%}",
        f"{np.mean(same_read):.0%}", f"{np.mean(diff_read):.2f}" if diff_read else "-",
        f"{np.mean(arg_same):.0%}", f"{np.mean(mean_diff):.3f}"])
  return table_rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", default="embedded")
  ap.add_argument("--text_tokens", type=int, default=1024)
  ap.add_argument("--profiles", type=int, default=5)
  ap.add_argument("--max_new_tokens", type=int, default=96)
  ap.add_argument("--max_context", type=int, default=2048)
  ap.add_argument("--skip_turns", action="store_true")
  ap.add_argument("--skip_texts", action="store_true")
  # XLA:CPU runs bf16 matmuls far slower than fp32; float32 compares int8 storage against the
  # unquantized model with both computing in fp32, so the difference is the int8 storage alone.
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                  help="simulator.dtype of every setting (the 'bf16' row's weights and compute)")
  ap.add_argument("--noise_floor", action="store_true", help="also bf16 against fp32 (no int8)")
  args = ap.parse_args()
  print(machine_info(), "\n", command_line(), flush=True)
  path = build.resolve_checkpoint(args.checkpoint, "--checkpoint")
  from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
  chat = ChatTokens(load_tokenizer(path))
  base = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
  if not args.skip_texts:
    backends = {name: build.simulator_backend(_spec(args, w, kv), None, seed=0)
                for name, (w, kv) in SETTINGS.items()}
    if args.noise_floor:
      backends["fp32"] = build.simulator_backend(
          dataclasses.replace(_spec(args, "bf16", "bf16"), dtype="float32"), None, seed=0)
    rows = distribution_rows(args, backends, chat)
    del backends
    print(table([f"int8 part (vs {base})", "tokens", f"mean KL({base}||int8) nats", "p99 KL",
                 "top-1 agreement"], rows), flush=True)
  if not args.skip_turns:
    print(table(["int8 part", "turns", f"change line read ({base} / int8)", "parsed change identical",
                 "mean |parsed diff|", "forced change argmax identical", "mean |forced mean diff|"],
                turn_rows(args, chat)), flush=True)


if __name__ == "__main__":
  main()
