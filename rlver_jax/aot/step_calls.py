"""The program calls of one training step, in the keys the trainer logs (`train.call_metrics`):
read from a recorded metrics.jsonl row, or laid out from stated lengths (lockstep, or continuous
batching on `rollout.rows` rows: with every dialogue of the same length, rows free up a wave at a time).

Keys (without the `calls/` prefix of metrics.jsonl): `policy/append/T64/W512` and
`policy/prefill/T1024/W64` (calls of an append chunk of T tokens at window W), `policy/decode_steps/W512`
(decode loop iterations at window W), `policy/decode_calls` (decode segments: a host round trip
each), the same under `simulator/`, and `update/micro_batches`, `update/rows`, `update/length`,
`forward/micro_batches` (see `train.call_metrics`). Stated lengths add, for one row:
`ROLE/decode_slots` (the filled cache slots summed over decode steps), `ROLE/peak_slots` (the most
slots a row fills), `simulator/answer_rounds` (simulator answers a dialogue, each one decode) and
`host/text_round_trips` (policy turns and simulator answers: text leaves the device for each).

With a draft (`aot.draft`) the simulator's answers are draft-and-verify calls, keyed as the trainer
records them (`sampling.call_counts`): `simulator/verify_passes/W` (target passes of k + 1 positions,
the closing pass included), `simulator/draft_steps/W` (k per pass but the closing one),
`simulator/verify_calls` (one per decode segment, as a plain decode's calls), and the draft's
appends under `simulator_draft/` (the same tokens as the simulator's). A pass yields
`Draft.per_pass` tokens on average; the first token of a call comes from the logits the caller
holds, so a call of n tokens takes (n - 1) / per_pass passes and the closing one.

The simulator's cache follows `simulator.info_flow`: 'chat' keeps every answer (analyses, plans,
drafts) in its cache; 'reference' and 'sage' rewind each private answer out of it once read
(`env.simulator`), so the cache holds the transcript plus the current request only.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Iterator


from rlver_jax.aot import programs as ap
from rlver_jax.aot.draft import Draft
from rlver_jax.parallel.sharding import batch_shards
from rlver_jax.rl.pack import step_places
from rlver_jax.sampling.sampler import bucket, window_buckets
from rlver_jax.spec import PolicySpec, RunSpec, SimulatorSpec

Calls = dict[str, float]


def calls_from_metrics(path: str, step: int | None = None) -> tuple[Calls, dict[str, float]]:
  """(calls, the row's measured seconds) of `step` (default: the last row) of a metrics.jsonl."""
  try:
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"--calls_from={path}: cannot read a metrics.jsonl ({e})") from None
  rows = [r for r in rows if step is None or r.get("step") == step]
  if not rows or not any(k.startswith("calls/") for k in rows[-1]):
    which = "any row" if step is None else f"step {step}"
    raise ValueError(f"--calls_from={path}: no calls/* metrics in {which} (a run before they were "
                     "logged, or a step that is not there)")
  row = rows[-1]
  calls = {k[len("calls/"):]: float(v) for k, v in row.items() if k.startswith("calls/")}
  measured = {k: float(row[k]) for k in ("rollout_seconds", "update_seconds", "step",
                                          "simulator/draft_acceptance") if k in row}
  return calls, measured


@dataclasses.dataclass(frozen=True)
class StatedLengths:
  """Token counts of a lockstep step: every dialogue the same, every phase as long as its rows."""
  turns: int               # policy replies per dialogue
  policy_tokens: int       # decode steps of a policy turn (lockstep: its longest row's)
  reply_tokens: int        # the visible reply (what the simulator reads; re-appended if thoughts drop)
  user_tokens: int         # a user line appended to the policy's cache
  simulator_tokens: int    # decode steps of one simulator answer
  policy_prompt: int       # the policy's opening prompt
  simulator_prompt: int    # the simulator's first prompt (persona, scene, rules)
  instruction_tokens: int  # an emotion or reply instruction appended to the simulator

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if getattr(self, f.name) < (1 if f.name == "turns" else 0):
        raise ValueError(f"--{f.name}={getattr(self, f.name)}: must be >= {1 if f.name == 'turns' else 0}")


class _Cache:
  """One row's lengths in a sampler's cache, emitting the calls the sampler would make."""

  def __init__(self, role: str, section: PolicySpec | SimulatorSpec, calls: Calls,
               draft: Draft | None = None):
    self.role, self.max_len, self.calls, self.draft = role, section.max_context, calls, draft
    self.buckets = tuple(sorted({min(b, self.max_len) for b in section.append_buckets}))
    self.windows = window_buckets(self.max_len)
    self.segment = section.decode_segment
    self.decode_windows = window_buckets(self.max_len, step=section.window_step)
    self.length = self.peak = 0

  def _add(self, key: str, n: float) -> None:
    self.calls[f"{self.role}/{key}"] = self.calls.get(f"{self.role}/{key}", 0.0) + n

  def append(self, tokens: int, kind: str = "append") -> None:
    tokens = min(tokens, self.max_len - self.length)
    for start in range(0, max(tokens, 1), self.buckets[-1]):
      n = min(self.buckets[-1], tokens - start)
      T = bucket(max(n, 1), self.buckets)
      self._add(f"{kind}/T{T}/W{bucket(max(self.length, 1), self.windows)}", 1)
      self.length += n

  def decode(self, tokens: int, max_new: int, reserve: int = 0) -> None:
    budget = max(min(max_new, self.max_len - reserve - self.length), 0)
    n = min(tokens, budget)
    seg = min(self.segment or max_new, max_new)
    for done in range(0, n, seg):  # `Sampler.decode`'s segments, each at its own window
      reach = self.length + done + min(seg, budget - done)
      if self.draft is not None:
        self._verify(min(seg, n - done), reach)
        continue
      self._add(f"decode_steps/W{bucket(max(reach, 1), self.decode_windows)}", min(seg, n - done))
      self._add("decode_calls", 1)
    if self.draft is None:
      # Cache slots filled when each step reads it (the new token's included): the floor's KV bytes.
      self._add("decode_slots", n * self.length + n * (n + 1) // 2)
    self.length += n
    self.peak = max(self.peak, self.length)

  def _verify(self, n: int, reach: int) -> None:
    """A draft-and-verify call (`SpeculativeSampler.decode`'s segment) of n tokens reaching `reach`."""
    k = self.draft.tokens
    passes = max(n - 1, 0) / self.draft.per_pass + 1
    self._add(f"verify_passes/W{bucket(max(reach, 1), self.decode_windows)}", passes)
    draft_window = bucket(min(reach + k, self.max_len), self.decode_windows)
    self._add(f"draft_steps/W{draft_window}", k * (passes - 1))
    self._add("verify_calls", 1)


def _policy_turns(spec: RunSpec, lengths: StatedLengths, policy: _Cache) -> list[int]:
  """The policy's prefill, decodes and appends; returns the length of each training sample."""
  p = spec.policy
  drop = p.think and not p.keep_thoughts
  policy.append(lengths.policy_prompt, "prefill")
  samples = []
  for turn in range(lengths.turns):
    start = policy.length
    policy.decode(lengths.policy_tokens, p.max_new_tokens, reserve=1)
    samples.append(policy.length)
    last = turn == lengths.turns - 1
    if drop:
      policy.length = start  # rewound: the thought leaves the cache
    new = (lengths.reply_tokens + 1 if drop else 1) + (0 if last else lengths.user_tokens)
    if last:
      policy.length += new  # the closing tokens are in the sample, no later call reads them
    else:
      policy.append(new)
  return samples if drop else [policy.length]


def _simulator_turns(spec: RunSpec, lengths: StatedLengths, sim: _Cache) -> int:
  """The simulator's appends and decodes for one dialogue; returns its answers (decodes)."""
  s = spec.simulator
  answers = 0

  def answer() -> None:
    nonlocal answers
    sim.decode(lengths.simulator_tokens, s.max_new_tokens)
    answers += 1

  if s.info_flow == "chat":
    sim.append(lengths.simulator_prompt)
    answer()  # the opening line
    for turn in range(lengths.turns):
      sim.append(lengths.reply_tokens + lengths.instruction_tokens)  # the reply, the emotion step
      answer()
      if turn < lengths.turns - 1:  # the last turn ends at max_turns without a user line
        sim.append(lengths.instruction_tokens)
        answer()
    return answers
  # 'reference' / 'sage': each answer is rewound once read; the user's visible line joins the
  # transcript with the next request.
  sim.append(lengths.simulator_prompt)
  transcript = sim.length
  answer()
  line = lengths.user_tokens
  for turn in range(lengths.turns):
    sim.length = transcript
    sim.append(line + lengths.reply_tokens + lengths.instruction_tokens)  # quoted reply, request
    transcript += line + lengths.reply_tokens
    answer()
    if turn < lengths.turns - 1:
      sim.length = transcript
      sim.append(lengths.instruction_tokens)  # the state label and the analysis's reading
      answer()
  return answers


def waves(spec: RunSpec) -> int:
  """How many times the stated-length rollout fills its rows: 1 in lockstep; with `rollout.rows` = R,
  whole groups start together, so R // group_size groups run at once and the dialogues, all of one
  length, end together and hand their rows to the next as many groups."""
  groups_at_once = ap.lent_rows(spec) // spec.rl.group_size
  return math.ceil(spec.rl.profiles_per_step / groups_at_once)


def stated_calls(spec: RunSpec, lengths: StatedLengths, mesh=None, draft: Draft | None = None
                 ) -> Calls:
  """The calls of a step in which every dialogue has `lengths` (one row stands for all), each
  sampler call repeated for every wave of dialogues (`waves`); the simulator's decodes
  draft-and-verify with `draft`."""
  calls: Calls = {}
  policy = _Cache("policy", spec.policy, calls)
  samples = _policy_turns(spec, lengths, policy)
  answers = 0
  if spec.simulator.backend == "model":
    sim = _Cache("simulator", spec.simulator, calls, draft)
    answers = _simulator_turns(spec, lengths, sim)
    calls["simulator/answer_rounds"] = float(answers)
    if draft is not None:
      calls.update(_draft_appends(calls))
  calls["host/text_round_trips"] = float(lengths.turns + answers)
  repeat = waves(spec)
  calls = {key: n * repeat for key, n in calls.items()}
  calls["policy/peak_slots"] = float(policy.peak)
  if spec.simulator.backend == "model":
    calls["simulator/peak_slots"] = float(sim.peak)
  layout, _ = step_places(samples * ap.num_dialogues(spec), ap.micro_batch_rows(spec, mesh),
                          mini_batch_rows=spec.rl.rows_per_mini_batch,
                          mini_batches=spec.rl.mini_batches,
                          shards=1 if mesh is None else batch_shards(mesh),
                          pack_length=spec.rl.update_pack_length)  # the trainer's rows
  M, B, T = layout.step_shape
  passes = 1 + (spec.rl.kl_coef > 0) + (spec.algo == "ppo")
  calls.update({"update/micro_batches": float(M * spec.rl.epochs), "update/rows": float(B),
                "update/length": float(T), "forward/micro_batches": float(M * passes)})
  return calls


def _draft_appends(calls: Calls) -> Calls:
  """The draft's appends: every simulator append and prefill goes to both caches."""
  return {f"simulator_draft/{k.partition('/')[2]}": n for k, n in calls.items()
          if k.startswith(("simulator/append/", "simulator/prefill/"))}


def with_draft(calls: Calls, draft: Draft) -> Calls:
  """`calls` of a step that decoded without a draft, its simulator decodes turned into
  draft-and-verify calls at the same windows (each call's steps as its tokens; the draft's window
  taken as the target's). Calls that hold verify passes already are returned as they are."""
  if any(k.startswith("simulator/verify_passes/") for k in calls):
    return dict(calls)
  out = {k: n for k, n in calls.items() if not k.startswith(("simulator/decode_steps/",
                                                             "simulator/decode_calls"))}
  decodes = {k: n for k, n in calls.items() if k.startswith("simulator/decode_steps/W")}
  if not decodes:
    return out
  calls_n = calls.get("simulator/decode_calls", 0.0)
  steps = sum(decodes.values())
  for key, n in decodes.items():
    w = key.rpartition("/W")[2]
    share = calls_n * n / steps  # the calls, spread over the windows like their steps
    passes = max(n - share, 0.0) / draft.per_pass + share
    out[f"simulator/verify_passes/W{w}"] = out.get(f"simulator/verify_passes/W{w}", 0.0) + passes
    out[f"simulator/draft_steps/W{w}"] = (out.get(f"simulator/draft_steps/W{w}", 0.0)
                                          + draft.tokens * (passes - share))
  out["simulator/verify_calls"] = calls_n
  out.update(_draft_appends(calls))
  return out


def sampler_keys(calls: Calls) -> Iterator[tuple[str, str, int | None, int, float]]:
  """(role, kind "append" | "decode" | "verify" | "draft", T or None, W, count) of each sampler
  entry of `calls` (role "simulator_draft": the draft's appends)."""
  kinds = {"decode_steps": "decode", "verify_passes": "verify", "draft_steps": "draft"}
  for key, n in sorted(calls.items()):
    parts = key.split("/")
    if parts[0] not in ("policy", "simulator", "simulator_draft") or not n:
      continue
    if parts[1] in ("append", "prefill"):
      yield parts[0], "append", int(parts[2][1:]), int(parts[3][1:]), n
    elif parts[1] in kinds:
      yield parts[0], kinds[parts[1]], None, int(parts[2][1:]), n
