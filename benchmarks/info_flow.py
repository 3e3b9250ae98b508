"""The simulator's information flows (`simulator.info_flow`, `eval.info_flow`) on the same simulator
and profiles.

SmolLM2-135M (the embedded model, fp32) as policy and as the co-located simulator, the 8 English
demo profiles, one dialogue each, no-think policy; the shapes of `:runlocal` by default (simulator
40 new tokens per step, no retries, 2 policy replies). All flows run with the same seeds, one after
the other. Reported per flow: score (mean final emotion), emotion steps whose change line could not
be read, reply steps without a reply line, simulator tokens per policy turn (prefilled + generated)
and the longest simulator context at the end.

  python benchmarks/info_flow.py [--turns 2] [--sim-new 40] [--retries 0] [--seeds 0]
"""
from __future__ import annotations

import argparse
import time

import _common  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _common import command_line, machine_info, table
from rlver_jax.env.info_flow import INFO_FLOWS
from rlver_jax.env.model_backend import ModelBackend
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.env.rollout import RolloutConfig, RolloutStats, run_dialogues
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.models import load_pretrained
from rlver_jax.models.embedded import embedded_model_dir
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams


def one_run(flow: str, model, params, chat: ChatTokens, args, seed: int) -> dict:
  policy = Sampler(model, max_len=1024, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                   append_buckets=(16, 64, 256, 1024))
  sim = Sampler(model, max_len=args.sim_context, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                append_buckets=(64, 128, 256, 512, 1024))
  backend = ModelBackend(sim, params, chat, max_new_tokens=args.sim_new,
                         sampling=SamplingParams.make(0.7, 0.9, 0), seed=seed + 1)
  profiles = load_demo_profiles()
  users = SimulatedUsers(profiles, backend, start_emotion=30, max_turns=args.turns,
                         max_parse_retries=args.retries, info_flow=flow)
  stats = RolloutStats()
  t0 = time.perf_counter()
  dialogues = run_dialogues(profiles, list(range(len(profiles))), users, sampler=policy, params=params,
                            chat=chat, cfg=RolloutConfig(think=False, max_new_tokens=32),
                            rng=jax.random.key(seed), stats=stats)
  steps = sum(len(d.parsed) for d in dialogues)
  return dict(score=float(np.mean([d.final_emotion for d in dialogues])),
              unread=sum(not p for d in dialogues for p in d.parsed), steps=steps,
              parse_failures=sum(d.parse_failures for d in dialogues),
              reply_failures=sum(d.reply_failures for d in dialogues),
              silent=sum(d.silent_replies for d in dialogues), turns=stats.policy_turns,
              sim_prefill=backend.prefill_tokens, sim_generated=backend.generated_tokens,
              context=max(len(t) for t in backend.tokens), seconds=time.perf_counter() - t0)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--turns", type=int, default=2)
  ap.add_argument("--sim-new", type=int, default=40)
  ap.add_argument("--sim-context", type=int, default=3072)
  ap.add_argument("--retries", type=int, default=0)
  ap.add_argument("--seeds", type=int, nargs="+", default=[0])
  args = ap.parse_args()
  path = embedded_model_dir()
  chat = ChatTokens(load_tokenizer(path))
  model, _ = load_pretrained(path, dtype=jnp.float32)
  params = nnx.state(model)
  total = {flow: [] for flow in INFO_FLOWS}
  for seed in args.seeds:
    for flow in INFO_FLOWS:
      r = one_run(flow, model, params, chat, args, seed)
      total[flow].append(r)
      print(f"seed {seed} {flow}: {r}", flush=True)
  print(f"\nCommand: `{command_line()}`\n\n{machine_info()}\n")
  rows = []
  for flow, runs in total.items():
    s = {k: sum(r[k] for r in runs) for k in runs[0]}
    rows.append([flow, f"{s['score'] / len(runs):.1f}", f"{s['unread']} of {s['steps']}",
                 s["reply_failures"], s["silent"],
                 f"{s['sim_prefill'] / s['turns']:.0f} + {s['sim_generated'] / s['turns']:.0f}",
                 max(r["context"] for r in runs), f"{s['seconds']:.0f}"])
  print(table(["info_flow", "score (mean final emotion)", "emotion steps unread",
               "reply answers without a line", "silent user lines",
               "simulator tokens / policy turn (prefilled + generated)", "longest simulator context",
               "seconds (incl. compiles)"], rows))


if __name__ == "__main__":
  main()
