"""The batched dialogue runner: policy turns and simulated-user turns for batches of dialogues.

Token-in, token-out: the policy's context is concatenated from ChatML token fragments and the tokens
it sampled, exactly as they sit in its KV cache; nothing is re-tokenised from decoded text. A
dialogue keeps its cache row for its whole life (addressed by dialogue id, never by position among
live rows). All dialogues run in lockstep, or with `rows` set, at most that many at once: an ended
dialogue's row goes at once to the next waiting group (continuous batching; `scheduler`).

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

from rlver_jax.env.answer_stops import sequence_stops
from rlver_jax.env.chat import (SYSTEM_PROMPTS, TRAINING_PROMPTS, parse_policy_output,
                                policy_system_prompt)
from rlver_jax.env.profiles import Profile
from rlver_jax.env.scheduler import AdmissionQueue, RowSlots, dialogue_keys
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.env.user_state import SIMULATOR_ERROR, TurnResult, UserState
from rlver_jax.models.tokenizer import ChatTokens
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams
from rlver_jax.parallel.sharding import host_array

REWARD_MODES = ("terminal", "per_turn")
# What `history_chars` counts: the dialogue's visible lines, or the policy's whole prompt as the
# chat template renders it (system prompt, role tags, the lines; the RLVER reference's measure).
HISTORY_MEASURES = ("visible", "rendered")


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
  system_prompt: str = "training"  # or "chat_partner", "sage" (chat.SYSTEM_PROMPTS)
  training_prompt: str = "project"  # which training prompt "training" is (chat.TRAINING_PROMPTS)
  share_prefix: bool = True      # rows of a group with the same opening prompt prefill it once
  stop_sequences: tuple[str, ...] = ()  # strings that end a policy turn on device (answer_stops)
  rows: int = 0                  # cache rows lent to dialogues (0: all at once, one key per turn)
  history_chars: int = 0         # end a dialogue whose history passes this (0: no limit) ...
  history_measure: str = "visible"  # ... counted as HISTORY_MEASURES says
  reply_cut: str = "label"       # what of a reply the user sees (chat.REPLY_CUTS)

  def __post_init__(self):
    if self.history_measure not in HISTORY_MEASURES:
      raise ValueError(f"unknown history_measure {self.history_measure!r}; expected one of "
                       f"{HISTORY_MEASURES}")
    if self.rows < 0:
      raise ValueError(f"rollout.rows={self.rows}: must be >= 0 (0 = a row per dialogue)")
    if self.reward_mode not in REWARD_MODES:
      raise ValueError(f"unknown reward_mode {self.reward_mode!r}; expected one of {REWARD_MODES}")
    if self.system_prompt not in SYSTEM_PROMPTS:
      raise ValueError(f"unknown system_prompt {self.system_prompt!r}; expected one of "
                       f"{SYSTEM_PROMPTS}")
    if self.training_prompt not in TRAINING_PROMPTS:
      raise ValueError(f"unknown training_prompt {self.training_prompt!r}; expected one of "
                       f"{TRAINING_PROMPTS}")

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
  parsed: list[bool] = dataclasses.field(default_factory=list)  # per emotion step: change was read

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
  """The policy's side of one dialogue: its token context (what its cache holds) and its turns."""
  ctx: list[int]
  mask: list[int]
  logp: list[float]
  turn_ends: list[int] = dataclasses.field(default_factory=list)
  samples: list[Sample] = dataclasses.field(default_factory=list)
  raw: list[str] = dataclasses.field(default_factory=list)
  replies: list[str] = dataclasses.field(default_factory=list)
  thoughts: list[str | None] = dataclasses.field(default_factory=list)
  format_ok: list[bool] = dataclasses.field(default_factory=list)
  system: str = ""  # the policy's system prompt (the rendered history measure counts it)

  def extend(self, tokens: list[int], mask: int = 0, logp: list[float] | None = None) -> None:
    """Appends tokens to the context: sampled ones (mask 1, their log-probs) or given ones."""
    self.ctx += tokens
    self.mask += [mask] * len(tokens)
    self.logp += logp if logp is not None else [0.0] * len(tokens)


@dataclasses.dataclass
class _Turn:
  """One policy turn's cache bookkeeping: per cache row, the length to go on from (rewound in
  split-turn mode) and the tokens to append before the next decode."""
  lengths: np.ndarray
  appends: list[list[int]]
  replies: list[str] = dataclasses.field(default_factory=list)  # the live rows' visible replies


@dataclasses.dataclass
class RolloutStats:
  policy_tokens: int = 0
  policy_turns: int = 0
  policy_prefill_tokens: int = 0  # tokens the policy ran as input (prompts, user turns, replies)
  simulator_prefill_tokens: int | None = None  # the same for a co-located simulator (set by the caller)
  simulator_cut_answers: int | None = None  # its answers cut at simulator.max_new_tokens (caller)


class RolloutInterrupted(Exception):
  """`should_stop` said so between two turns (e.g. SIGTERM): the dialogues are dropped unfinished."""


def run_dialogues(profiles: Sequence[Profile], group_ids: Sequence[int], users: SimulatedUsers, *,
                  sampler: Sampler, params, chat: ChatTokens, cfg: RolloutConfig,
                  rng: jax.Array, stats: RolloutStats | None = None,
                  should_stop: Callable[[], bool] | None = None) -> list[Dialogue]:
  """Runs every dialogue to its end; returns one Dialogue per profile, in dialogue-id order.

  With `cfg.rows` set, at most that many dialogues hold a cache row at once; an ended one's row goes
  to the next waiting group (see `scheduler`). `should_stop` is polled before each turn (on every
  host alike: it may be a collective); when it returns True, RolloutInterrupted is raised.
  """
  rollout = _Rollout(users, sampler, params, chat, cfg,
                     stats if stats is not None else RolloutStats(), profiles, group_ids, rng)
  rollout.admit()
  while rollout.live():
    if should_stop is not None and should_stop():
      raise RolloutInterrupted()
    live = rollout.live()
    turn = rollout.policy_turn(live)
    rollout.user_turn(users.step(live, turn.replies), turn)
    rollout.advance(turn)
    rollout.admit()
  return [_finish(b, rollout.rows[b], profiles[b], group_ids[b], users.records[b], cfg)
          for b in range(len(profiles))]


class _Rollout:
  """The policy's half of a batched rollout: its rows, its KV cache and the phases of a turn.

  The simulated users (`users`) own the dialogue state (emotions, rewards, endings); this side
  only reads it, and ends a dialogue through `users.end` when the policy's context is full. Cache
  rows are lent to dialogues (`slots`): with `cfg.rows` = 0 all dialogues start at once, dialogue b
  in row b, and each turn samples from one key split off `rng`; else each dialogue samples from its
  own stream (`scheduler.dialogue_keys`, folded with its policy turn).
  """

  def __init__(self, users: SimulatedUsers, sampler: Sampler, params, chat: ChatTokens,
               cfg: RolloutConfig, stats: RolloutStats, profiles: Sequence[Profile],
               group_ids: Sequence[int], rng: jax.Array):
    self.users, self.sampler, self.params, self.chat = users, sampler, params, chat
    self.cfg, self.stats, self.rng = cfg, stats, rng
    self.profiles, self.group_ids = list(profiles), list(group_ids)
    self.sampling = SamplingParams.make(cfg.temperature, cfg.top_p, cfg.top_k)
    self.rows: list[_Row | None] = [None] * len(self.profiles)
    lent = min(cfg.rows, len(self.profiles)) if cfg.rows else len(self.profiles)
    self.slots = RowSlots(max(lent, 1))
    self.queue = AdmissionQueue(self.group_ids, self.slots.rows)
    # Cache rows: the lent rows, then inactive ones up to a sharded batch.
    self.cache = self.sampler.init_cache(self.sampler.padded_rows(self.slots.rows))
    self.logits = None

  def live(self) -> list[int]:
    """The dialogues holding a row and still running, ascending."""
    return sorted(d for d in self.slots.row_of if not self.users.records[d].done)

  def admit(self) -> None:
    """Rows of ended dialogues go back; waiting groups start in the free rows (an opening that
    ends its dialogue at once frees its row again)."""
    while True:
      for d in [d for d in self.slots.row_of if self.users.records[d].done]:
        self.slots.release(d)
        self.users.release(d)
      new = self.queue.next_dialogues(self.slots.free)
      if not new:
        return
      self._start(new)

  def _start(self, dialogues: list[int]) -> None:
    """The users' openings, then each new row's opening prompt prefilled into its row while the
    others keep theirs (a group's rows with the same prompt once, their KV rows copied)."""
    for d, line in zip(dialogues, self.users.opening(dialogues)):
      self.rows[d] = self._opening_row(d, self.profiles[d], line)
      self.slots.take(d)
    slot = self.slots.row_of
    first: dict = {}
    copies = {slot[d]: slot[first.setdefault((self.group_ids[d], tuple(self.rows[d].ctx)), d)]
              for d in dialogues}
    copies = {dst: src for dst, src in copies.items() if dst != src and self.cfg.share_prefix}
    prompts = [[] for _ in range(self.cache.batch_size)]
    for d in dialogues:
      if slot[d] not in copies:
        prompts[slot[d]] = self.rows[d].ctx
    self.stats.policy_prefill_tokens += sum(len(p) for p in prompts)
    if self.logits is None:  # the first start: every row is new (today's one prefill)
      cache, logits = self.sampler.prefill(self.params, self.cache, prompts)
    else:  # the new rows from 0, the others untouched
      lengths = host_array(self.cache.lengths).copy()
      lengths[[slot[d] for d in dialogues]] = 0
      cache, logits = self.sampler.append(self.params, self.cache.with_lengths(lengths), prompts,
                                          self.logits)
    self.cache, self.logits = self.sampler.copy_rows(cache, logits, copies)

  def _turn_key(self) -> jax.Array:
    """Lockstep: one key per turn; lent rows: each row's dialogue's stream at its policy turn."""
    if not self.cfg.rows:
      self.rng, key = jax.random.split(self.rng)
      return key
    holders = self.slots.holders(self.cache.batch_size)
    return dialogue_keys(self.rng, holders, [0 if d is None else len(self.rows[d].raw)
                                             for d in holders])

  def _opening_row(self, b: int, profile: Profile, opening: str) -> _Row:
    lang = self.cfg.language or profile.language
    system = policy_system_prompt(self.cfg.think, lang, self.cfg.system_prompt,
                                  self.cfg.training_prompt)
    ctx = self.chat.conversation([{"role": "system", "content": system},
                                  {"role": "user", "content": opening}], add_generation_prompt=True)
    # Room must remain for at least one sampled token and the closing <|im_end|>; else the policy's
    # turn would be empty and the simulator would judge a reply nobody wrote.
    if len(ctx) + 2 > self.sampler.max_len:
      raise ValueError(f"dialogue {b} (profile {profile.id}): the opening prompt is {len(ctx)} "
                       f"tokens, leaving no room for a reply within policy.max_context="
                       f"{self.sampler.max_len} (needs at least {len(ctx) + 2})")
    return _Row(ctx=ctx, mask=[0] * len(ctx), logp=[0.0] * len(ctx), system=system)

  def policy_turn(self, live: list[int]) -> _Turn:
    """Decodes one reply for every live dialogue and records it."""
    C = self.cache.batch_size
    slot = self.slots.row_of
    active = np.zeros(C, bool)
    active[[slot[d] for d in live]] = True
    # One slot stays free so a reply cut by the cache can still be closed with <|im_end|>.
    stops = sequence_stops(self.chat, self.cfg.stop_sequences, C, self.sampler.config.vocab_size)
    res = self.sampler.decode(self.params, self.cache, self.logits, rng=self._turn_key(),
                              max_new_tokens=self.cfg.max_new_tokens, sampling=self.sampling,
                              active=active, reserve=1, stop_rules=stops)
    self.cache = res.cache
    turn = _Turn(lengths=host_array(self.cache.lengths).copy(), appends=[[] for _ in range(C)])
    for d in live:
      gen = res.row(slot[d])
      logp = res.sample_logp[slot[d], : len(gen)].tolist()
      turn.replies.append(self._record_reply(d, slot[d], gen, logp, turn))
    return turn

  def _record_reply(self, b: int, s: int, gen: list[int], gen_logp: list[float],
                    turn: _Turn) -> str:
    """Adds dialogue `b`'s sampled tokens (cache row `s`) to its context or samples; returns its
    visible reply."""
    self.stats.policy_tokens += len(gen)
    self.stats.policy_turns += 1
    row, chat = self.rows[b], self.chat
    parsed = parse_policy_output(chat.decode(gen, skip_special_tokens=True), self.cfg.think,
                                 self.cfg.reply_cut)
    row.raw.append(chat.decode(gen, skip_special_tokens=False))
    row.replies.append(parsed.reply)
    row.thoughts.append(parsed.thought)
    row.format_ok.append(parsed.format_ok)
    if self.cfg.split_turns:
      start = len(row.ctx)
      row.samples.append(Sample(b, row.ctx + gen, [0] * start + [1] * len(gen),
                                [0.0] * start + gen_logp, [start + len(gen) - 1]))
      turn.lengths[s] = start  # rewind: the thought leaves the cache, only the visible reply goes in
      shown = chat.encode(parsed.reply) + [chat.im_end]
      turn.appends[s] += shown
      row.extend(shown)
    else:
      row.extend(gen, 1, gen_logp)
      row.turn_ends.append(len(row.ctx) - 1)
      # Cut by the budget, or stopped by another stop id (<|endoftext|>): close the turn as the
      # template does (not sampled, so mask 0).
      if gen[-1:] != [chat.im_end]:
        turn.appends[s].append(chat.im_end)
        row.extend([chat.im_end])
    return parsed.reply

  def user_turn(self, results: Sequence[TurnResult], turn: _Turn) -> None:
    """Queues each still-running dialogue's user line; one that no longer fits ends (context_full)."""
    chat = self.chat
    for r in results:
      if r.done:
        continue
      limit = self.cfg.history_chars
      if limit and history_chars(self.users.records[r.row], self.cfg.history_measure,
                                 self.rows[r.row].system) > limit:
        self.users.end(r.row, "history_long")
        continue
      s = self.slots.row_of[r.row]
      user = chat.encode("\n") + chat.message("user", r.user_reply or "") + chat.generation_header()
      # Room must remain for at least one sampled token and the closing <|im_end|>.
      if turn.lengths[s] + len(turn.appends[s]) + len(user) + 2 > self.sampler.max_len:
        self.users.end(r.row, "context_full")
        continue
      turn.appends[s] += user
      self.rows[r.row].extend(user)

  def advance(self, turn: _Turn) -> None:
    """Appends the queued tokens to the cache (from the rewound lengths) for the next decode."""
    for d, s in self.slots.row_of.items():  # a finished dialogue never samples again
      if self.users.records[d].done:
        turn.appends[s] = []
    self.cache = self.cache.with_lengths(turn.lengths)
    self.stats.policy_prefill_tokens += sum(len(a) for a in turn.appends)
    self.cache, self.logits = self.sampler.append(self.params, self.cache, turn.appends, self.logits)


def history_chars(rec: UserState, measure: str = "visible", system: str = "") -> int:
  """The length of the dialogue's history before the next policy turn (HISTORY_MEASURES): its
  visible lines (the user's and the policy's), or the policy's prompt rendered as ChatML text with
  `system` first, every line in its role's tags, and the next turn's header."""
  lines = sum(len(line) for line in rec.replies) + sum(len(line) for line in rec.policy_replies)
  if measure == "visible":
    return lines
  roles = ["system"] + ["user"] * len(rec.replies) + ["assistant"] * len(rec.policy_replies)
  tags = sum(len(f"<|im_start|>{role}\n<|im_end|>\n") for role in roles)
  return len(system) + lines + tags + len("<|im_start|>assistant\n")


def _finish(b: int, row: _Row, profile: Profile, group_id: int, rec: UserState,
            cfg: RolloutConfig) -> Dialogue:
  """The finished dialogue: the policy's samples with their rewards, and the user's record."""
  reward = rec.reward
  penalised = cfg.think and cfg.format_penalty and not all(row.format_ok)
  if penalised:
    reward = 0.0
  samples = row.samples if cfg.split_turns else [
      Sample(b, row.ctx, row.mask, row.logp, row.turn_ends)]
  samples = [s for s in samples if s.turn_ends]
  if rec.termination == SIMULATOR_ERROR:  # cut short by the backend, not by the policy: not trained
    samples, reward = [], 0.0
  deltas = [0.0 if penalised else d for d in rec.turn_rewards]  # a format violation zeroes them
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
      silent_replies=rec.silent_replies, parsed=list(rec.parsed))
