"""Rollout throughput: SmolLM2 as policy and as simulated user, cache-keeping vs re-prefilling.

The `cached` rollout is the package's own: `run_dialogues` on a policy Sampler and a ModelBackend
simulator, both appending each turn's new tokens onto their kept KV caches. The `re-prefill`
rollout runs the same code with both samplers swapped for `RePrefillSampler` (defined here, not in
the package): it mirrors every row's tokens on the host and turns each `append` into a prefill of
the row's whole history (the cache rows are emptied first), as a cache-less implementation would.
Same seeds; after a warm-up rollout per variant (compiles), timed rollouts alternate. The
`cached+stops` variant (`--variants`) is `cached` with the on-device stop rules on: the simulator's
decodes end after their change / reply line (`simulator.stop_at_lines`) and the policy's at
"<|im_start|>" (`policy.stop_sequences`). The `continuous` variant is `cached` with continuous
batching on half as many cache rows as dialogues (`rollout.rows`): an ended dialogue's row goes to
the next waiting one. `--user scripted-ends` swaps the model simulator for the scripted user, saying
goodbye at turn 1 + d % turns in dialogue d, so the dialogues end at different turns (where
continuous batching has rows to refill) and the policy is all the model time.

  python benchmarks/rollout_throughput.py [--dialogues 8] [--turns 4] [--policy-new 32] [--sim-new 48]
  python benchmarks/rollout_throughput.py --quick   # 2 dialogues x 2 turns
  python benchmarks/rollout_throughput.py --variants cached,cached+stops   # with/without stop rules
  python benchmarks/rollout_throughput.py --batching   # cached,continuous with --user scripted-ends
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time

import _common  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _common import CompileCounter, command_line, machine_info, median, table
from rlver_jax.env.backends import ScriptedBackend
from rlver_jax.env.model_backend import ModelBackend
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.env.rollout import RolloutConfig, RolloutStats, run_dialogues
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.models import load_pretrained
from rlver_jax.models.embedded import embedded_model_dir
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams


COUNTER = CompileCounter()
REPO = pathlib.Path(__file__).resolve().parents[1]


def _overhead() -> float:
  return COUNTER.seconds + COUNTER.frontend_seconds


class TimedSampler(Sampler):
  """A Sampler that adds up the seconds spent in append (waited for) and decode, less compiles."""

  seconds = 0.0
  appended = 0  # tokens actually run through append programs (padding excluded)

  def _timed(self, fn, *args, **kwargs):
    t0, c0 = time.perf_counter(), _overhead()
    out = jax.block_until_ready(fn(*args, **kwargs))
    self.seconds += time.perf_counter() - t0 - (_overhead() - c0)
    return out

  def append(self, params, cache, rows, prev_logits=None, **kwargs):
    self.appended += sum(len(r) for r in rows)
    return self._timed(super().append, params, cache, rows, prev_logits, **kwargs)

  def decode(self, *args, **kwargs):
    return self._timed(super().decode, *args, **kwargs)


class RePrefillSampler(TimedSampler):
  """Keeps a host mirror of each row's cached tokens; an append re-prefills the whole row history.

  Rows with new tokens are emptied and refilled with (mirror[:cached length] + new tokens); the
  cached length honours rewinds (`cache.with_lengths`). Rows without new tokens are left alone.
  """

  mirror: list[list[int]] = []

  def append(self, params, cache, rows, prev_logits=None, **kwargs):
    lengths = np.asarray(jax.device_get(cache.lengths))
    if len(self.mirror) != len(rows):
      self.mirror = [[] for _ in rows]
    self.mirror = [m[: int(n)] + list(r) for m, n, r in zip(self.mirror, lengths, rows)]
    has_new = np.array([len(r) > 0 for r in rows])
    cache = cache.with_lengths(np.where(has_new, 0, lengths).astype(np.int32))
    full = [m if h else [] for m, h in zip(self.mirror, has_new)]
    return super().append(params, cache, full, prev_logits, **kwargs)

  def decode(self, *args, **kwargs):
    res = super().decode(*args, **kwargs)
    for b in range(len(self.mirror)):
      self.mirror[b] = self.mirror[b] + res.row(b)
    return res


class EndingUser(ScriptedBackend):
  """The scripted user, but dialogue d says goodbye in its reply of policy turn 1 + d % turns."""

  def __init__(self, turns: int, first: int = 0):
    """`first`: the id of row 0's dialogue (a wave of `lockstep-half` starts past 0)."""
    super().__init__()
    self.turns, self.first = turns, first
    self.replies: list[int] = []

  def reset(self, num_rows: int) -> None:
    super().reset(num_rows)
    self.replies = [0] * num_rows

  def _one(self, r):
    if r.kind != "reply":
      return super()._one(r)
    self.replies[r.row] += 1
    if self.replies[r.row] == 1 + (self.first + r.row) % self.turns:
      return "Plan: leave now.\nReply: Goodbye, and thank you."
    return super()._one(r)


def trainer_buckets() -> dict[str, tuple[int, ...]]:
  """Append buckets per role as the shipped training config sets them."""
  spec = importlib.util.spec_from_file_location("base", REPO / "configs" / "base.py")
  base = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(base)
  c = base.get_base_config("grpo", True, None)
  return {role: tuple(c[role].append_buckets) for role in ("policy", "simulator")}


def make_samplers(kind: str, model, chat: ChatTokens, args):
  cls = RePrefillSampler if kind.startswith("re-prefill") else TimedSampler
  buckets = trainer_buckets()
  policy = cls(model, max_len=args.policy_context, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
               append_buckets=buckets["policy"])
  sim = cls(model, max_len=args.sim_context, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
            append_buckets=buckets["simulator"])
  return policy, sim


def waves(model, params, chat: ChatTokens, args, seed: int) -> dict:
  """`lockstep-half`: the same dialogues as `continuous` on as many rows, but in lockstep waves of
  half the dialogues each (the scripted-ends user; what a lockstep rollout does on those rows)."""
  policy, _ = make_samplers("cached", model, chat, args)
  half = max(args.dialogues // 2, 1)
  profiles = (load_demo_profiles() * args.dialogues)[: args.dialogues]
  stats, done, t0, c0 = RolloutStats(), [], time.perf_counter(), _overhead()
  for first in range(0, len(profiles), half):
    part = profiles[first:first + half]
    users = SimulatedUsers(part, EndingUser(args.turns, first), style="vanilla", start_emotion=30,
                           max_turns=args.turns, max_parse_retries=1)
    cfg = RolloutConfig(think=args.think, max_new_tokens=args.policy_new, temperature=1.0)
    done += run_dialogues(part, list(range(len(part))), users, sampler=policy, params=params, chat=chat,
                          cfg=cfg, rng=jax.random.fold_in(jax.random.key(seed), first), stats=stats)
  wall, compile_s = time.perf_counter() - t0, _overhead() - c0
  return dict(wall=wall - compile_s, compile_s=compile_s, turns=stats.policy_turns,
              policy_tokens=stats.policy_tokens, policy_s=policy.seconds, policy_in=policy.appended,
              sim_tokens=0, sim_s=float("nan"), sim_in=0, sim_context=0,
              dialogues_s=len(done) / (wall - compile_s),
              turns_per_dialogue=float(np.mean([len(d.policy_replies) for d in done])), parse_failures=0)


# What each variant turns on: stop rules, continuous batching (on half the rows), a group's shared
# prefix prefilled once (only differs from "cached" with --group-size > 1).
FEATURES = {"cached": (False, False, True), "re-prefill": (False, False, True),
            "cached+stops": (True, False, True), "continuous": (False, True, True),
            "unshared": (False, False, False), "all": (True, True, True)}


def dialogue_groups(args) -> tuple[list, list[int]]:
  """The step's profiles and group ids: dialogues // group_size demo profiles, group_size each."""
  g = args.group_size
  base = (load_demo_profiles() * args.dialogues)[: args.dialogues // g]
  return [p for p in base for _ in range(g)], [i for i in range(len(base)) for _ in range(g)]


def rollout(kind: str, model, params, chat: ChatTokens, args, seed: int) -> dict:
  """One batch of dialogues; returns wall time, per-model seconds and token counts."""
  if kind == "lockstep-half":
    return waves(model, params, chat, args, seed)
  policy, sim = make_samplers(kind, model, chat, args)
  stops, continuous, share = FEATURES[kind]
  rows = max(args.dialogues // 2, args.group_size) if continuous else 0
  if args.user == "scripted-ends":
    backend = EndingUser(args.turns)
  else:
    backend = ModelBackend(sim, params, chat, max_new_tokens=args.sim_new, rows=rows, seed=seed + 1,
                           sampling=SamplingParams.make(0.7, 0.9, 0), stop_at_lines=stops,
                           share_prefix=share)
  profiles, groups = dialogue_groups(args)
  users = SimulatedUsers(profiles, backend, style="vanilla", start_emotion=30, max_turns=args.turns,
                         max_parse_retries=args.retries, groups=groups if args.group_size > 1 else None)
  cfg = RolloutConfig(think=args.think, max_new_tokens=args.policy_new, temperature=1.0,
                      stop_sequences=("<|im_start|>",) if stops else (), rows=rows, share_prefix=share)
  stats = RolloutStats()
  t0, c0 = time.perf_counter(), _overhead()
  dialogues = run_dialogues(profiles, groups, users, sampler=policy, params=params,
                            chat=chat, cfg=cfg, rng=jax.random.key(seed), stats=stats)
  wall = time.perf_counter() - t0
  compile_s = _overhead() - c0
  if kind.startswith("re-prefill") and isinstance(backend, ModelBackend):  # the mirror is exactly
    assert all(sim.mirror[b] == backend.tokens[b] for b in range(len(profiles)))  # what is cached
  model_user = isinstance(backend, ModelBackend)
  return dict(wall=wall - compile_s, compile_s=compile_s, turns=stats.policy_turns, policy_tokens=stats.policy_tokens,
              policy_s=policy.seconds, policy_in=policy.appended,
              sim_tokens=backend.generated_tokens if model_user else 0,
              sim_s=sim.seconds if model_user else float("nan"), sim_in=sim.appended,
              sim_context=max(len(t) for t in backend.tokens) if model_user else 0,
              dialogues_s=len(dialogues) / (wall - compile_s),
              turns_per_dialogue=float(np.mean([len(d.policy_replies) for d in dialogues])),
              parse_failures=sum(r.parse_failures for r in users.records))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--dialogues", type=int, default=8)
  ap.add_argument("--turns", type=int, default=4)
  ap.add_argument("--policy-new", type=int, default=32)
  ap.add_argument("--sim-new", type=int, default=48)
  ap.add_argument("--policy-context", type=int, default=1024)
  ap.add_argument("--sim-context", type=int, default=4096, help="3072 (runlocal) overflows at 4 turns")
  ap.add_argument("--no-think", dest="think", action="store_false")
  ap.add_argument("--reps", type=int, default=1, help="timed rollouts per variant")
  ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                  help="skip the untimed warm-up rollout (compile time is subtracted either way)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--variants", default="cached,re-prefill",
                  help="comma-separated: cached, re-prefill, cached+stops (on-device stop rules), "
                  "continuous (cached on dialogues // 2 cache rows), unshared (cached without the "
                  "groups' shared prefix), all (stops + continuous + shared prefix), lockstep-half "
                  "(lockstep waves on as many rows; --user scripted-ends only)")
  ap.add_argument("--user", default="model", choices=("model", "scripted-ends"),
                  help="the simulated user: SmolLM2, or the scripted one ending dialogues at turns 1..")
  ap.add_argument("--batching", action="store_true",
                  help="lockstep vs continuous batching: --variants cached,continuous,lockstep-half "
                  "--user scripted-ends")
  ap.add_argument("--quick", action="store_true",
                  help="2 dialogues x 2 turns (max_turns as in :runlocal), no warm-up: fits a slow CPU")
  ap.add_argument("--group-size", type=int, default=1,
                  help="dialogues per profile (a GRPO group: they share their opening and prefix)")
  ap.add_argument("--retries", type=int, default=1, help="simulator.max_parse_retries")
  ap.add_argument("--runlocal", action="store_true",
                  help="grpo_think.py:runlocal's per-dialogue shapes (policy 32 / simulator 40 new "
                  "tokens, 1k / 3k caches, 2 turns, no parse retry, groups of 2) on --dialogues "
                  "dialogues; variants unshared (all off), cached (shared prefix), cached+stops, "
                  "continuous, all")
  args = ap.parse_args()
  if args.quick:
    args.dialogues, args.turns, args.warmup = 2, 2, False
  if args.runlocal:
    args.policy_new, args.sim_new, args.policy_context, args.sim_context = 32, 40, 1024, 3072
    args.turns, args.retries, args.group_size = 2, 0, 2
    if args.variants == ap.get_default("variants"):
      args.variants = "unshared,cached,cached+stops,continuous,all"
  if args.dialogues % args.group_size:
    raise SystemExit(f"--dialogues {args.dialogues} is not a multiple of --group-size {args.group_size}")
  if args.batching:
    args.variants, args.user = "cached,continuous,lockstep-half", "scripted-ends"

  path = embedded_model_dir()
  chat = ChatTokens(load_tokenizer(path))
  model, _ = load_pretrained(path, dtype=jnp.float32)
  params = nnx.state(model)
  kinds = tuple(args.variants.split(","))
  known = tuple(FEATURES) + ("lockstep-half",)
  bad = [k for k in kinds if k not in known]
  if bad:
    raise SystemExit(f"--variants: unknown variant {bad[0]!r} ({', '.join(known)})")
  if "lockstep-half" in kinds and args.user != "scripted-ends":
    raise SystemExit("--variants=lockstep-half needs --user scripted-ends")
  warm, runs = None, {k: [] for k in kinds}
  if args.warmup:  # compiles most programs (jit caches are shared by every Sampler of this model)
    COUNTER.reset()
    warm = rollout("cached", model, params, chat, args, args.seed)
    warm["compiles"] = COUNTER.count
    print(f"warm-up cached: {warm['wall'] + warm['compile_s']:.1f} s incl. {warm['compile_s']:.1f} s "
          f"compile ({warm['compiles']} programs)", flush=True)
  for rep in range(args.reps):
    for k in kinds:
      COUNTER.reset()
      r = rollout(k, model, params, chat, args, args.seed)
      r["compiles"] = COUNTER.count
      runs[k].append(r)
      print(f"timed {k}: {r['wall']:.1f} s net of {r['compile_s']:.1f} s compile ({r['compiles']} "
            f"programs), {r['turns']} policy turns, policy {r['policy_tokens']} tok in "
            f"{r['policy_s']:.1f} s, simulator {r['sim_tokens']} tok in {r['sim_s']:.1f} s", flush=True)

  print()
  print(f"Command: `{command_line()}`\n")
  print(machine_info() + "\n")
  user = ("the scripted user, goodbye at turn 1 + d % max_turns in dialogue d" if
          args.user == "scripted-ends" else f"simulator {args.sim_new} (T=0.7, top-p 0.9)")
  print(f"{args.dialogues} dialogues (demo profiles, groups of {args.group_size}), max_turns={args.turns}, "
        f"parse retries {args.retries}, think={args.think}, policy "
        f"{args.policy_new} new tokens/turn (T=1.0), {user}; fp32 SmolLM2-135M, caches "
        f"{args.policy_context} / {args.sim_context} slots; continuous: "
        f"{max(args.dialogues // 2, args.group_size)} rows. "
        f"{args.reps} timed rollout(s) per variant (alternating, medians) after "
        f"{'one warm-up rollout' if args.warmup else 'no warm-up'}; every time is net of the XLA "
        f"compile + trace seconds measured during it (jax.monitoring).\n")
  res = {k: {f: median([r[f] for r in runs[k]]) for f in runs[k][0]} for k in kinds}
  rows = []
  for k in kinds:
    r = res[k]
    rows.append([k, f"{r['wall']:.1f}", r["turns"], f"{r['turns'] / r['wall']:.3f}",
                 f"{r['dialogues_s']:.3f}",
                 f"{r['policy_tokens']} / {r['policy_s']:.1f}",
                 f"{r['policy_tokens'] / r['policy_s']:.1f}", f"{r['sim_tokens']} / {r['sim_s']:.1f}",
                 f"{r['sim_tokens'] / r['sim_s']:.1f}",
                 f"{(r['policy_tokens'] + r['sim_tokens']) / r['wall']:.1f}",
                 f"{r['policy_in']:,} / {r['sim_in']:,}"])
  print(table(["variant", "wall s", "policy turns", "turns/s", "dialogues/s", "policy gen tok / its s",
               "policy tok/s", "sim gen tok / its s", "sim tok/s", "all gen tok/s (wall)",
               "tokens prefilled policy / sim"], rows))
  for other in ("re-prefill", "cached+stops", "continuous"):
    if "cached" in res and other in res:
      print()
      print(ratio_table(res["cached"], res[other], other))
  for other in ("cached", "all"):  # what sharing, and every change together, buy over none of them
    if "unshared" in res and other in res:
      print()
      print(ratio_table(res[other], res["unshared"], other, base="unshared"))
  if "continuous" in res and "lockstep-half" in res:  # the same rows, scheduled two ways
    print()
    print(ratio_table(res["lockstep-half"], res["continuous"], "continuous").replace(
        "continuous / cached", "continuous / lockstep-half"))
  print()
  print(table(["variant", "compiles in timed run", "compile+trace s subtracted",
               "mean policy turns/dialogue", "longest simulator context (tokens)", "parse failures"],
              [[k, res[k]["compiles"], f"{res[k]['compile_s']:.1f}", f"{res[k]['turns_per_dialogue']:.2f}",
                res[k]["sim_context"], res[k]["parse_failures"]] for k in kinds]))
  if warm:
    print(f"\nWarm-up (cached, first in the process): {warm['wall'] + warm['compile_s']:.1f} s of which "
          f"{warm['compile_s']:.1f} s compile + trace, {warm['compiles']} XLA programs.")


def ratio_table(c: dict, p: dict, other: str, base: str = "cached") -> str:
  """`cached` against another variant: > 1x means the other is slower. With `base` given, `c` is
  the variant `other` and `p` the base: > 1x means `other` is faster."""
  if base != "cached":
    head = f"ratio {other} / {base}"
  elif other in ("cached+stops", "continuous"):
    c, p = p, c  # the stop rules' / continuous batching's speed-up: it / plain
    head = f"ratio {other} / cached"
  else:
    head = "ratio cached / re-prefill"
  return table([head, "value"], [
      ["turns/s", f"{(c['turns'] / c['wall']) / (p['turns'] / p['wall']):.2f}x"],
      ["policy tok/s (its own time)", f"{(c['policy_tokens'] / c['policy_s']) / (p['policy_tokens'] / p['policy_s']):.2f}x"],
      ["simulator tok/s (its own time)", f"{(c['sim_tokens'] / c['sim_s']) / (p['sim_tokens'] / p['sim_s']):.2f}x"],
      ["dialogues/s", f"{c['dialogues_s'] / p['dialogues_s']:.2f}x"],
      ["wall time", f"{p['wall'] / c['wall']:.2f}x"],
  ])


if __name__ == "__main__":
  main()
