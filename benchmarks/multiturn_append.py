"""Multi-turn dialogue on our sampler: `append` onto the kept KV cache vs re-prefilling the history.

8 rows, 8 turns. Turn 0 prefills a system prompt + a user message; every later turn appends a
~60-token user message. Each turn then decodes exactly `--decode` tokens (greedy, no stop ids), so
both paths do the same sampling work and should produce the same tokens:
  append:    sampler.append(new tokens) on the cache kept from the last turn, then decode;
  re-prefill: sampler.prefill(whole history so far), then decode.
Each path runs on its own Sampler after `jax.clear_caches()`, so its first pass counts its own XLA
compiles; later passes (alternating append / re-prefill) are timed.

  python benchmarks/multiturn_append.py [--rows 8] [--turns 8] [--user 60] [--decode 32] [--passes 2]
"""
from __future__ import annotations

import argparse
import time

import _common  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _common import CompileCounter, command_line, machine_info, median, table
from rlver_jax.models import load_pretrained
from rlver_jax.models.embedded import embedded_model_dir
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams

SYSTEM = "You are a warm, empathetic listener. Reply briefly and kindly."
TOPICS = ["work stress", "a fight with my sister", "failing an exam", "not sleeping", "a friend moving away",
          "a missed promotion", "an old sick dog", "feeling lonely in a new city"]


def user_turn(chat: ChatTokens, row: int, turn: int, total: int) -> list[int]:
  """Closes the previous assistant turn and adds a user message + assistant header: `total` tokens."""
  text = (f"Turn {turn}: I keep thinking about {TOPICS[row % len(TOPICS)]}. " * 12)
  head = [chat.im_end] + chat.encode("\n") + [chat.im_start] + chat.encode("user\n")
  tail = [chat.im_end] + chat.encode("\n") + chat.generation_header()
  return head + chat.encode(text)[: total - len(head) - len(tail)] + tail


def first_turn(chat: ChatTokens, row: int, total: int) -> list[int]:
  """System prompt + the first user message (same user length as later turns)."""
  return chat.message("system", SYSTEM) + user_turn(chat, row, 0, total)[1 + len(chat.encode("\n")):]


def new_tokens(chat: ChatTokens, rows: int, turn: int, user: int) -> list[list[int]]:
  if turn == 0:
    return [first_turn(chat, b, user) for b in range(rows)]
  return [user_turn(chat, b, turn, user) for b in range(rows)]


def run_path(kind: str, sampler: Sampler, params, chat: ChatTokens, args,
             counter: CompileCounter) -> tuple[list[float], np.ndarray]:
  """One dialogue batch; returns (seconds per turn net of compile + trace time, tokens [rows, turns, N])."""
  B = args.rows
  cache, logits = sampler.init_cache(B), None
  history = [[] for _ in range(B)]
  times, out = [], []
  greedy = SamplingParams.make(0.0)
  for turn in range(args.turns):
    new = new_tokens(chat, B, turn, args.user)
    for b in range(B):
      history[b] += new[b]
    t0, c0 = time.perf_counter(), counter.seconds + counter.frontend_seconds
    if kind == "append" and turn > 0:
      cache, logits = sampler.append(params, cache, new, logits)
    else:
      cache, logits = sampler.prefill(params, cache, history)
    res = sampler.decode(params, cache, logits, rng=jax.random.key(turn), max_new_tokens=args.decode,
                         sampling=greedy)
    compiling = counter.seconds + counter.frontend_seconds - c0
    times.append(time.perf_counter() - t0 - compiling)
    cache = res.cache
    assert (res.num_tokens == args.decode).all(), res.num_tokens
    for b in range(B):
      history[b] += res.row(b)
    out.append(res.tokens)
  return times, np.stack(out, axis=1)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--turns", type=int, default=8)
  ap.add_argument("--user", type=int, default=60, help="tokens appended per user turn")
  ap.add_argument("--decode", type=int, default=32, help="tokens decoded per turn")
  ap.add_argument("--max-len", type=int, default=1024)
  ap.add_argument("--passes", type=int, default=1,
                  help="passes per path; the first compiles (its times are net of compile + trace "
                       "seconds), later ones are timed and used when present")
  args = ap.parse_args()

  path = embedded_model_dir()
  chat = ChatTokens(load_tokenizer(path))
  model, _ = load_pretrained(path, dtype=jnp.float32)
  params = nnx.state(model)
  counter = CompileCounter()
  kinds = ("append", "re-prefill")
  samplers = {k: Sampler(model, max_len=args.max_len, stop_ids=[-1], pad_id=chat.pad_id) for k in kinds}

  first, timed_runs, tokens, programs = {}, {k: [] for k in kinds}, {}, {}
  for p in range(args.passes):
    for k in kinds:
      if p == 0:
        jax.clear_caches()
        counter.reset()
      times, tokens[k] = run_path(k, samplers[k], params, chat, args, counter)
      if p == 0:
        first[k] = (sum(times), counter.count, counter.seconds, counter.frontend_seconds)
        programs[k] = counter.programs()
      if p > 0 or args.passes == 1:
        timed_runs[k].append(times)
      print(f"pass {p} {k}: {sum(times):.1f} s net  per turn " + " ".join(f"{t:.2f}" for t in times),
            flush=True)

  print()
  print(f"Command: `{command_line()}`\n")
  print(machine_info() + "\n")
  hist = [len(first_turn(chat, 0, args.user)) + t * (args.user + args.decode) for t in range(args.turns)]
  timing = (f"{args.passes - 1} timed pass(es) per path after the compile pass; medians."
            if args.passes > 1 else "One pass per path; times are net of the compile + trace seconds "
            "measured during each turn (jax.monitoring events).")
  print(f"{args.rows} rows x {args.turns} turns, {args.user}-token user turns, {args.decode} greedy tokens "
        f"decoded per turn (no stop ids), fp32 SmolLM2-135M, cache {args.max_len} slots, append buckets "
        f"{samplers['append'].append_buckets}. History before each turn's decode (tokens): {hist}. "
        f"{timing}\n")
  rows, totals = [], {}
  for k in kinds:
    net, n, comp, front = first[k]
    totals[k] = float(np.median(np.array(timed_runs[k]), axis=0).sum())
    rows.append([k, f"{totals[k]:.2f}", f"{totals[k] / args.turns:.2f}", "", n, f"{comp:.2f}",
                 f"{front:.2f}", f"{net + comp + front:.2f}"])
  rows[0][3] = f"{totals['re-prefill'] / totals['append']:.2f}x"
  rows[1][3] = "1.00x"
  print(table(["path", "total s", "per-turn s (mean)", "speedup vs re-prefill", "XLA compiles",
               "backend compile s", "trace+lower s", "first pass s (incl. compiles)"], rows))
  print()
  per = {k: np.median(np.array(timed_runs[k]), axis=0) for k in kinds}
  print(table(["seconds in turn"] + [str(t) for t in range(args.turns)],
              [[k] + [f"{x:.2f}" for x in per[k]] for k in kinds]))
  print()
  print(table(["path", "programs compiled in the first pass"], [[k, programs[k]] for k in kinds]))
  same = (tokens["append"] == tokens["re-prefill"]).mean()
  print(f"\nGreedy tokens identical on both paths: {same:.1%} of {tokens['append'].size}.")


if __name__ == "__main__":
  main()
