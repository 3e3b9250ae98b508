"""The batched dialogue runner: policy turns and simulated-user turns in lockstep for all dialogues.

Token-in, token-out: the policy's context is concatenated from ChatML token fragments and the tokens
it sampled, exactly as they sit in its KV cache; nothing is re-tokenised from decoded text. A
dialogue keeps its row for its whole life (rows are dialogue ids, never positions among live rows).

Think mode with dropped thoughts rewinds a row's cache to where the turn began and appends only the
visible reply, so later turns see the reply without the thought; each policy turn is then its own
training sample (context = what the policy saw, response = its raw output). Otherwise one sample
per dialogue carries every policy turn under its loss mask.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from rlver_jax.env.chat import parse_policy_output, policy_system_prompt
from rlver_jax.env.profiles import Profile
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.models.tokenizer import ChatTokens
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams
from rlver_jax.sharding import host_array

REWARD_MODES = ("terminal", "per_turn")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  think: bool = True
  keep_thoughts: bool = False    # think mode: keep earlier thoughts in the policy's later context
  max_new_tokens: int = 1024     # per policy turn
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  reward_mode: str = "terminal"  # "terminal": final emotion / 100; "per_turn": emotion deltas / 100
  format_penalty: bool = False   # think mode: reward 0 when any turn breaks the think format
  language: str | None = None    # policy system prompt language; None: each profile's own

  def __post_init__(self):
    if self.reward_mode not in REWARD_MODES:
      raise ValueError(f"unknown reward_mode {self.reward_mode!r}; expected one of {REWARD_MODES}")

  @property
  def split_turns(self) -> bool:
    return self.think and not self.keep_thoughts


@dataclasses.dataclass
class Sample:
  """One training sequence: token ids, 1 on tokens the policy sampled, the sampler's log-probs."""
  dialogue: int
  tokens: list[int]
  loss_mask: list[int]
  sampler_logp: list[float]
  turn_ends: list[int]     # index of the last token of each policy turn in `tokens`
  token_rewards: dict[int, float] = dataclasses.field(default_factory=dict)  # token index -> reward


@dataclasses.dataclass
class Dialogue:
  row: int
  profile: Profile
  group_id: int
  samples: list[Sample]
  policy_raw: list[str]
  policy_replies: list[str]
  policy_thoughts: list[str | None]
  format_ok: list[bool]
  user_lines: list[str]
  emotions: list[int]
  changes: list[int]
  reasoning: list[str]
  termination: str
  parse_failures: int
  reward: float
  reply_failures: int = 0  # simulator answers without a usable reply line (each retry counted)
  silent_replies: int = 0  # user lines shown as silence: still no reply line after the retries

  @property
  def final_emotion(self) -> int:
    return self.emotions[-1]

  def transcript(self) -> dict:
    turns = []
    for i, user in enumerate(self.user_lines):
      replied = i < len(self.policy_replies)
      turns.append({
          "user": user,
          "policy": self.policy_replies[i] if replied else None,
          "policy_thought": self.policy_thoughts[i] if replied else None,
          "change": self.changes[i] if replied else None,
          "emotion": self.emotions[i + 1] if replied else self.emotions[-1],
          "simulator_reasoning": self.reasoning[i] if replied else None,
      })
    return {"profile_id": self.profile.id, "task": self.profile.task,
            "main_cha": self.profile.main_cha, "group_id": self.group_id,
            "termination": self.termination, "final_emotion": self.final_emotion,
            "reward": self.reward, "turns": turns}


@dataclasses.dataclass
class _Row:
  ctx: list[int]
  mask: list[int]
  logp: list[float]
  turn_ends: list[int] = dataclasses.field(default_factory=list)
  samples: list[Sample] = dataclasses.field(default_factory=list)
  raw: list[str] = dataclasses.field(default_factory=list)
  replies: list[str] = dataclasses.field(default_factory=list)
  thoughts: list[str | None] = dataclasses.field(default_factory=list)
  format_ok: list[bool] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RolloutStats:
  policy_tokens: int = 0
  policy_turns: int = 0


class RolloutInterrupted(Exception):
  """`should_stop` said so between two turns (e.g. SIGTERM): the dialogues are dropped unfinished."""


def run_dialogues(profiles: Sequence[Profile], group_ids: Sequence[int], users: SimulatedUsers, *,
                  sampler: Sampler, params, chat: ChatTokens, cfg: RolloutConfig,
                  rng: jax.Array, stats: RolloutStats | None = None,
                  should_stop: Callable[[], bool] | None = None) -> list[Dialogue]:
  """Runs every dialogue to its end; returns one Dialogue per profile, in row order.

  `should_stop` is polled before each turn (on every host alike: it may be a collective); when it
  returns True, RolloutInterrupted is raised.
  """
  stats = stats if stats is not None else RolloutStats()
  B = len(profiles)
  sampling = SamplingParams.make(cfg.temperature, cfg.top_p, cfg.top_k)
  openings = users.opening()
  rows: list[_Row] = []
  for p, opening in zip(profiles, openings):
    lang = cfg.language or p.language
    ctx = chat.conversation([{"role": "system", "content": policy_system_prompt(cfg.think, lang)},
                             {"role": "user", "content": opening}], add_generation_prompt=True)
    # Room must remain for at least one sampled token and the closing <|im_end|>; else the policy's
    # turn would be empty and the simulator would judge a reply nobody wrote.
    if len(ctx) + 2 > sampler.max_len:
      raise ValueError(f"dialogue {len(rows)} (profile {p.id}): the opening prompt is {len(ctx)} "
                       f"tokens, leaving no room for a reply within policy.max_context="
                       f"{sampler.max_len} (needs at least {len(ctx) + 2})")
    rows.append(_Row(ctx=ctx, mask=[0] * len(ctx), logp=[0.0] * len(ctx)))
  C = sampler.padded_rows(B)  # cache rows: B dialogues, then inactive rows up to a sharded batch
  cache, logits = sampler.prefill(params, sampler.init_cache(C),
                                  [r.ctx for r in rows] + [[]] * (C - B))

  while not users.done:
    if should_stop is not None and should_stop():
      raise RolloutInterrupted()
    live = users.live_rows()
    active = np.zeros(C, bool)
    active[live] = True
    rng, key = jax.random.split(rng)
    # One slot stays free so a reply cut by the cache can still be closed with <|im_end|>.
    res = sampler.decode(params, cache, logits, rng=key, max_new_tokens=cfg.max_new_tokens,
                         sampling=sampling, active=active, reserve=1)
    cache = res.cache
    lengths = host_array(cache.lengths).copy()
    replies, appends = [], [[] for _ in range(C)]
    for b in live:
      gen = res.row(b)
      stats.policy_tokens += len(gen)
      stats.policy_turns += 1
      row = rows[b]
      parsed = parse_policy_output(chat.decode(gen, skip_special_tokens=True), cfg.think)
      row.raw.append(chat.decode(gen, skip_special_tokens=False))
      row.replies.append(parsed.reply)
      row.thoughts.append(parsed.thought)
      row.format_ok.append(parsed.format_ok)
      replies.append(parsed.reply)
      gen_logp = res.sample_logp[b, : len(gen)].tolist()
      if cfg.split_turns:
        start = len(row.ctx)
        row.samples.append(Sample(b, row.ctx + gen, [0] * start + [1] * len(gen),
                                  [0.0] * start + gen_logp, [start + len(gen) - 1]))
        lengths[b] = start  # rewind: the thought leaves the cache, only the visible reply goes back
        shown = chat.encode(parsed.reply) + [chat.im_end]
        appends[b] += shown
        row.ctx += shown
        row.mask += [0] * len(shown)
        row.logp += [0.0] * len(shown)
      else:
        row.ctx += gen
        row.mask += [1] * len(gen)
        row.logp += gen_logp
        row.turn_ends.append(len(row.ctx) - 1)
        # Cut by the budget, or stopped by another stop id (<|endoftext|>): close the turn as the
        # template does (not sampled, so mask 0).
        if gen[-1:] != [chat.im_end]:
          appends[b].append(chat.im_end)
          row.ctx.append(chat.im_end)
          row.mask.append(0)
          row.logp.append(0.0)
    results = users.step(live, replies)
    for r in results:
      if r.done:
        continue
      user = chat.encode("\n") + chat.message("user", r.user_reply or "") + chat.generation_header()
      # Room must remain for at least one sampled token and the closing <|im_end|>.
      if lengths[r.row] + len(appends[r.row]) + len(user) + 2 > sampler.max_len:
        users.records[r.row].termination = "context_full"
        continue
      appends[r.row] += user
      rows[r.row].ctx += user
      rows[r.row].mask += [0] * len(user)
      rows[r.row].logp += [0.0] * len(user)
    for b in range(B):  # a finished row never samples again: its cache needs nothing more
      if users.records[b].done:
        appends[b] = []
    cache = cache.with_lengths(lengths)
    cache, logits = sampler.append(params, cache, appends, logits)

  return [_finish(b, rows[b], profiles[b], group_ids[b], users, cfg) for b in range(B)]


def _finish(b: int, row: _Row, profile: Profile, group_id: int, users: SimulatedUsers,
            cfg: RolloutConfig) -> Dialogue:
  rec = users.records[b]
  reward = max(rec.emotion / 100.0, 0.0)
  penalised = cfg.think and cfg.format_penalty and not all(row.format_ok)
  if penalised:
    reward = 0.0
  samples = row.samples if cfg.split_turns else [
      Sample(b, row.ctx, row.mask, row.logp, row.turn_ends)]
  samples = [s for s in samples if s.turn_ends]
  # Per-turn rewards are the emotion's actual moves (the simulator's stated change is clipped to
  # [0, 100] when applied), so they sum to (final - start) / 100; a format violation zeroes them.
  deltas = [0.0 if penalised else d / 100.0 for d in np.diff(rec.emotions).tolist()]
  for i, s in enumerate(samples):
    if cfg.reward_mode == "terminal":
      s.token_rewards = {s.turn_ends[-1]: reward}
    elif cfg.split_turns:  # turn i's sample earns the emotion still to come from turn i on
      s.token_rewards = {s.turn_ends[-1]: float(sum(deltas[i:]))}
    else:
      s.token_rewards = {end: d for end, d in zip(s.turn_ends, deltas)}
  return Dialogue(
      row=b, profile=profile, group_id=int(group_id), samples=samples, policy_raw=row.raw,
      policy_replies=row.replies, policy_thoughts=row.thoughts, format_ok=row.format_ok,
      user_lines=list(rec.replies), emotions=list(rec.emotions), changes=list(rec.changes),
      reasoning=list(rec.reasoning), termination=rec.termination or "unknown",
      parse_failures=rec.parse_failures, reward=reward, reply_failures=rec.reply_failures,
      silent_replies=rec.silent_replies)
