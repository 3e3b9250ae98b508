"""The dialogue runner: token-in/token-out against the chat template, loss masks, row pairing, rewards,
and the co-located model backend's append-only cache."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlver_jax.env.backends import ScriptedBackend, SimulatorBackend
from rlver_jax.env.chat import policy_system_prompt
from rlver_jax.evaluation.scoring import summarize
from rlver_jax.env.model_backend import ModelBackend
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.env.rollout import RolloutConfig, _finish, _Row, run_dialogues
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.env.user_state import UserState
from rlver_jax.models.factory import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams


@pytest.fixture(scope="module")
def smol():
  from rlver_jax.models.embedded import embedded_model_dir
  path = embedded_model_dir()
  return path, ChatTokens(load_tokenizer(path))


@pytest.fixture(scope="module")
def tiny_policy(smol):
  """A 1-layer random model over SmolLM2's vocabulary: fast, and its outputs are arbitrary ids."""
  _, chat = smol
  cfg = Qwen2Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=16, tie_word_embeddings=True, qkv_bias=False)
  model = create_model(cfg, dtype=jnp.float32, seed=3, init_std=0.5)
  sampler = Sampler(model, max_len=1024, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                    append_buckets=(64, 512))
  return model, sampler


def _rollout(smol, tiny_policy, cfg, profiles, max_turns=3, seed=0):
  _, chat = smol
  model, sampler = tiny_policy
  users = SimulatedUsers(profiles, ScriptedBackend(), start_emotion=30, max_turns=max_turns)
  return run_dialogues(profiles, list(range(len(profiles))), users, sampler=sampler,
                       params=nnx.state(model), chat=chat, cfg=cfg, rng=jax.random.key(seed)), users


def _expected(chat, messages, assistant_ids):
  """Template tokens of `messages`, with each assistant content replaced by the sampled ids.

  Returns (tokens, mask) where mask is 1 exactly on the sampled ids (the closing <|im_end|> counts as
  sampled when the sampler produced it).
  """
  tok = chat.tokenizer
  marks = []
  msgs = []
  for m in messages:
    if m["role"] == "assistant" and m.get("sampled"):
      marks.append(f"\x00A{len(marks)}\x00")
      msgs.append({"role": "assistant", "content": marks[-1]})
    else:
      msgs.append({"role": m["role"], "content": m["content"]})
  text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=messages[-1]["role"] == "user")
  tokens, mask = [], []
  for i, mark in enumerate(marks + [None]):
    piece, _, text = text.partition(mark) if mark else (text, "", "")
    ids = tok.encode(piece, add_special_tokens=False)
    if i > 0 and assistant_ids[i - 1][-1] == chat.im_end:
      assert ids[0] == chat.im_end  # the template's closing tag is the sampler's own stop token
      ids = ids[1:]
    tokens += ids
    mask += [0] * len(ids)
    if mark:
      tokens += assistant_ids[i]
      mask += [1] * len(assistant_ids[i])
  return tokens, mask


def _spans(mask):
  """[start, end) of each run of 1s."""
  out, start = [], None
  for i, m in enumerate(list(mask) + [0]):
    if m and start is None:
      start = i
    if not m and start is not None:
      out.append((start, i))
      start = None
  return out


def test_tokens_equal_template_rendering_no_think(smol, tiny_policy):
  _, chat = smol
  cfg = RolloutConfig(think=False, max_new_tokens=12, temperature=1.0)
  profiles = load_demo_profiles()[:3]
  dialogues, _ = _rollout(smol, tiny_policy, cfg, profiles)
  for d in dialogues:
    assert len(d.samples) == 1
    s = d.samples[0]
    gen = [s.tokens[a:b] for a, b in _spans(s.loss_mask)]
    assert len(gen) == len(d.policy_replies)
    messages = [{"role": "system", "content": policy_system_prompt(False, "en")}]
    for i, user in enumerate(d.user_lines):
      messages.append({"role": "user", "content": user})
      if i < len(d.policy_replies):
        messages.append({"role": "assistant", "sampled": True})
    # The trajectory ends after the last policy turn (a final user line is never appended).
    if messages[-1]["role"] == "user":
      messages.pop()
    tokens, mask = _expected(chat, messages, gen)
    n = len(s.tokens)
    assert s.tokens == tokens[:n]
    assert s.loss_mask == mask[:n]
    # Log-probs exist exactly on sampled tokens.
    assert all((lp != 0.0) == bool(m) for lp, m in zip(s.sampler_logp, s.loss_mask) if m)
    assert all(lp == 0.0 for lp, m in zip(s.sampler_logp, s.loss_mask) if not m)


def test_think_mode_splits_turns_and_drops_thoughts(smol, tiny_policy):
  _, chat = smol
  model, _ = tiny_policy
  cfg = RolloutConfig(think=True, keep_thoughts=False, max_new_tokens=10, temperature=1.0)
  profiles = load_demo_profiles()[3:5]
  dialogues, _ = _rollout(smol, tiny_policy, cfg, profiles, max_turns=2, seed=1)
  rewound = 0
  for d in dialogues:
    for t, s in enumerate(d.samples):
      # The cache was rewound to drop the raw output: each turn's recorded log-probs (T=1) are a
      # full forward's over exactly the sample's tokens, whose history holds only visible replies.
      (start, end), = _spans(s.loss_mask)
      logits = np.asarray(model(jnp.asarray([s.tokens]))[0], np.float64)
      tokens = np.array(s.tokens[start:end])
      prev = logits[start - 1:end - 1]
      want = prev[np.arange(len(tokens)), tokens] - _logsumexp(prev)
      np.testing.assert_allclose(s.sampler_logp[start:end], want, atol=2e-3)
      if t > 0:
        (p_start, p_end), = _spans(d.samples[t - 1].loss_mask)
        raw = d.samples[t - 1].tokens[p_start:p_end]
        rewound += s.tokens[p_start:p_end] != raw  # the raw output is not what stayed in the history
  assert rewound > 0
  for d in dialogues:
    assert len(d.samples) == len(d.policy_replies)
    for t, s in enumerate(d.samples):
      # Context: the history with visible replies only (canonical re-encoding), then the raw output.
      messages = [{"role": "system", "content": policy_system_prompt(True, "en")}]
      for i in range(t + 1):
        messages.append({"role": "user", "content": d.user_lines[i]})
        if i < t:
          messages.append({"role": "assistant", "content": d.policy_replies[i]})
      spans = _spans(s.loss_mask)
      assert len(spans) == 1 and spans[0][1] == len(s.tokens)
      context = chat.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
      context = list(context["input_ids"] if hasattr(context, "keys") else context)
      assert s.tokens[: spans[0][0]] == context
      assert s.token_rewards == {len(s.tokens) - 1: d.reward}


def test_rows_keep_their_dialogue_and_rewards(smol, tiny_policy):
  cfg = RolloutConfig(think=False, max_new_tokens=8)
  profiles = load_demo_profiles()
  dialogues, users = _rollout(smol, tiny_policy, cfg, profiles, max_turns=4, seed=2)
  for b, d in enumerate(dialogues):
    rec = users.records[b]
    assert d.profile.id == profiles[b].id == rec.profile.id
    assert d.user_lines == rec.replies and d.policy_replies == rec.policy_replies
    assert d.reward == pytest.approx(max(rec.emotion / 100, 0.0))
    assert d.emotions[0] == 30 and d.emotions[-1] == d.final_emotion
    assert np.sum(d.changes) == d.final_emotion - 30 or d.final_emotion in (0, 100)
    # The backend's context for this row holds this row's profile and the replies it was sent.
    history = users.backend.history(b)
    assert profiles[b].player[:40] in history[0]["content"]
    sent = [m["content"] for m in history if m["role"] == "user"]
    for reply in d.policy_replies:
      assert any(reply in m for m in sent)


def test_per_turn_rewards_sum_to_the_emotion_change(smol, tiny_policy):
  cfg = RolloutConfig(think=False, max_new_tokens=8, reward_mode="per_turn")
  dialogues, _ = _rollout(smol, tiny_policy, cfg, load_demo_profiles()[:2], max_turns=3, seed=4)
  for d in dialogues:
    s = d.samples[0]
    assert sorted(s.token_rewards) == s.turn_ends
    assert sum(s.token_rewards.values()) == pytest.approx((d.emotions[-1] - d.emotions[0]) / 100)


def _record(start, changes, profile):
  rec = UserState(row=0, profile=profile, language="en", emotion=start)
  for c in changes:
    rec.apply(c)
  rec.termination = rec.emotion_termination(max_turns=len(changes)) or "max_turns"
  return rec


@pytest.mark.parametrize("start,changes,expected", [
    (95, [10], [0.05]),              # clipped at 100: the reply moved emotion by 5, not 10
    (4, [-10], [-0.04]),             # clipped at 0
    (50, [10, -20, 5], [0.10, -0.20, 0.05]),
])
def test_per_turn_rewards_are_the_clipped_emotion_moves(start, changes, expected):
  profile = load_demo_profiles()[0]
  rec = _record(start, changes, profile)
  n = len(changes)
  row = _Row(ctx=list(range(10 * n)), mask=[0, 1] * 5 * n, logp=[0.0] * 10 * n,
             turn_ends=[10 * i + 9 for i in range(n)], format_ok=[True] * n)
  d = _finish(0, row, profile, 0, rec,
              RolloutConfig(think=False, reward_mode="per_turn"))
  assert list(d.samples[0].token_rewards.values()) == pytest.approx(expected)
  assert sum(expected) == pytest.approx((rec.emotion - start) / 100)


@pytest.mark.parametrize("reward_mode", ["terminal", "per_turn"])
def test_format_penalty_zeroes_every_reward(reward_mode):
  profile = load_demo_profiles()[0]
  rec = _record(40, [10, 10], profile)
  row = _Row(ctx=list(range(20)), mask=[1] * 20, logp=[0.1] * 20, turn_ends=[9, 19],
             format_ok=[True, False])
  cfg = RolloutConfig(think=True, keep_thoughts=True, reward_mode=reward_mode, format_penalty=True)
  d = _finish(0, row, profile, 0, rec, cfg)
  assert d.reward == 0.0
  assert all(r == 0.0 for r in d.samples[0].token_rewards.values())
  ok = _finish(0, dataclasses.replace(row, format_ok=[True, True]), profile, 0,
               rec, cfg)
  assert sum(ok.samples[0].token_rewards.values()) == pytest.approx(0.2 if reward_mode == "per_turn" else 0.6)


def test_a_reply_that_fills_the_cache_ends_the_dialogue(smol, tiny_policy):
  # 200 new tokens cannot fit after the ~150-token prompt in 256 slots: the reply is cut by the
  # cache (keeping one slot for the closing <|im_end|>) and the dialogue ends as context_full.
  _, chat = smol
  model, _ = tiny_policy
  sampler = Sampler(model, max_len=256, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                    append_buckets=(64, 256))
  profiles = load_demo_profiles()[:2]
  for think, keep in ((False, False), (True, True)):
    users = SimulatedUsers(profiles, ScriptedBackend(), start_emotion=30, max_turns=4)
    cfg = RolloutConfig(think=think, keep_thoughts=keep, max_new_tokens=200, temperature=1.0)
    dialogues = run_dialogues(profiles, [0, 1], users, sampler=sampler, params=nnx.state(model),
                              chat=chat, cfg=cfg, rng=jax.random.key(5))
    for d in dialogues:
      assert d.termination == "context_full", d.termination
      s = d.samples[0]
      assert len(s.tokens) == len(s.loss_mask) == len(s.sampler_logp) <= 256
      assert s.tokens[-1] == chat.im_end and s.loss_mask[-1] == 0  # closed by us, not sampled


def _opening_prompt_length(chat, profile):
  probe = SimulatedUsers([profile], ScriptedBackend(), start_emotion=30)
  opening = probe.opening()[0]
  return len(chat.conversation([{"role": "system", "content": policy_system_prompt(False, "en")},
                                {"role": "user", "content": opening}], add_generation_prompt=True))


def test_an_opening_prompt_without_room_for_a_reply_is_an_error(smol, tiny_policy):
  # With max_len = prompt + 1 the decode budget is 0 (one slot is kept for <|im_end|>): the policy
  # turn would be empty and the simulator would still judge it.
  _, chat = smol
  model, _ = tiny_policy
  profiles = load_demo_profiles()[:1]
  n = _opening_prompt_length(chat, profiles[0])
  cfg = RolloutConfig(think=False, max_new_tokens=4)
  sampler = Sampler(model, max_len=n + 1, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                    append_buckets=(64, 512))
  users = SimulatedUsers(profiles, ScriptedBackend(), start_emotion=30, max_turns=2)
  with pytest.raises(ValueError, match=rf"opening prompt is {n} tokens.*policy\.max_context={n + 1}"):
    run_dialogues(profiles, [0], users, sampler=sampler, params=nnx.state(model), chat=chat,
                  cfg=cfg, rng=jax.random.key(0))
  assert users.records[0].policy_replies == [] and users.records[0].emotions == [30]
  # One more slot: a one-token reply, judged, then the context is full.
  sampler = Sampler(model, max_len=n + 2, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                    append_buckets=(64, 512))
  users = SimulatedUsers(profiles, ScriptedBackend(), start_emotion=30, max_turns=2)
  [d] = run_dialogues(profiles, [0], users, sampler=sampler, params=nnx.state(model), chat=chat,
                      cfg=cfg, rng=jax.random.key(0))
  assert len(d.policy_replies) == 1 and d.termination == "context_full"
  assert sum(d.samples[0].loss_mask) == 1 and d.samples[0].turn_ends == [n]


def test_recorded_logps_at_temperature_below_one(smol, tiny_policy, monkeypatch):
  # At T=1 the sampling and model log-probs coincide; at T=0.7 the recorded ones must be the
  # sampling distribution's, log_softmax(logits / T), and the model's stay log_softmax(logits).
  _, chat = smol
  model, sampler = tiny_policy
  temperature = 0.7
  decoded = []
  decode = sampler.decode
  monkeypatch.setattr(sampler, "decode", lambda *a, **k: decoded.append(decode(*a, **k)) or decoded[-1])
  cfg = RolloutConfig(think=False, max_new_tokens=6, temperature=temperature)
  dialogues, _ = _rollout(smol, tiny_policy, cfg, load_demo_profiles()[:2], max_turns=2, seed=7)
  gap = 0.0
  for b, d in enumerate(dialogues):
    s = d.samples[0]
    logits = np.asarray(model(jnp.asarray([s.tokens]))[0], np.float64)  # a full forward, no cache
    spans = _spans(s.loss_mask)
    assert len(spans) == len(d.policy_replies) >= 1
    for k, (start, end) in enumerate(spans):
      res = decoded[k]
      assert res.row(b) == s.tokens[start:end]
      tokens = np.array(s.tokens[start:end])
      prev = logits[start - 1:end - 1]
      scaled = prev / temperature
      want_sample = scaled[np.arange(len(tokens)), tokens] - _logsumexp(scaled)
      want_model = prev[np.arange(len(tokens)), tokens] - _logsumexp(prev)
      np.testing.assert_allclose(s.sampler_logp[start:end], want_sample, atol=2e-3)
      np.testing.assert_allclose(res.model_logp[b, :end - start], want_model, atol=2e-3)
      gap = max(gap, float(np.abs(want_sample - want_model).max()))
  assert gap > 0.1  # the two distributions differ enough to tell apart


def _logsumexp(x):
  m = x.max(-1)
  return m + np.log(np.exp(x - m[:, None]).sum(-1))


@pytest.mark.parametrize("penalised", [False, True])
def test_rates_are_on_the_reward(penalised):
  # Finals 100, 100, 45, 5: the first under a format penalty when `penalised` (reward 0).
  profile = load_demo_profiles()[0]
  cfg = RolloutConfig(think=True, keep_thoughts=True, format_penalty=True)
  dialogues = []
  for i, changes in enumerate([[10] * 7, [10] * 7, [10, 5], [-10, -10, -5]]):
    rec = _record(30, changes, profile)
    n = len(changes)
    ok = [not (penalised and i == 0)] + [True] * (n - 1)
    row = _Row(ctx=list(range(2 * n)), mask=[0, 1] * n, logp=[0.0] * 2 * n,
               turn_ends=[2 * t + 1 for t in range(n)], format_ok=ok)
    dialogues.append(_finish(0, row, profile, 0, rec, cfg))
  assert [d.final_emotion for d in dialogues] == [100, 100, 45, 5]
  assert [d.reward for d in dialogues] == pytest.approx([0.0 if penalised else 1.0, 1.0, 0.45, 0.05])
  s = summarize(dialogues)
  assert s["score"] == pytest.approx(62.5)
  assert s["success_rate"] == pytest.approx(0.25 if penalised else 0.5)
  assert s["failure_rate"] == pytest.approx(0.5 if penalised else 0.25)
  assert s["positive_rate"] == pytest.approx(0.5 if penalised else 0.75)
  [group] = s["by_task"].values()
  assert group["success_rate"] == s["success_rate"] and group["failure_rate"] == s["failure_rate"]


def test_rate_thresholds_at_their_edges():
  # Spec: success at 100 (99 is not), failure below 10 (10 is not), positive above 40 (40 is not).
  profile = load_demo_profiles()[0]
  cfg = RolloutConfig(think=False)
  dialogues = []
  for change in (-20, -21, 10, 11, 69, 70):  # from 30: finals 10, 9, 40, 41, 99, 100
    row = _Row(ctx=[0, 1], mask=[0, 1], logp=[0.0, 0.0], turn_ends=[1], format_ok=[True])
    rec = _record(30, [change], profile)
    dialogues.append(_finish(0, row, profile, 0, rec, cfg))
  assert [d.final_emotion for d in dialogues] == [10, 9, 40, 41, 99, 100]
  s = summarize(dialogues)
  assert s["failure_rate"] == pytest.approx(1 / 6)
  assert s["positive_rate"] == pytest.approx(3 / 6)
  assert s["success_rate"] == pytest.approx(1 / 6)


def test_colocated_model_backend_two_dialogues(smol, tiny_policy):
  # SmolLM2's tokenizer and chat template with the random 1-layer model: what is checked (the cache
  # holds each row's history, appended == prefilled) does not depend on the weights.
  _, chat = smol
  model, _ = tiny_policy
  params = nnx.state(model)
  sim_sampler = Sampler(model, max_len=2048, stop_ids=chat.stop_ids, pad_id=chat.pad_id)
  backend = ModelBackend(sim_sampler, params, chat, max_new_tokens=8,
                         sampling=SamplingParams.make(0.7, 0.9), seed=0)
  assert isinstance(backend, SimulatorBackend) and backend.prefill_tokens == 0
  policy_sampler = Sampler(model, max_len=1024, stop_ids=chat.stop_ids, pad_id=chat.pad_id)
  profiles = load_demo_profiles()[:2]
  users = SimulatedUsers(profiles, backend, start_emotion=30, max_turns=2, max_parse_retries=0)
  cfg = RolloutConfig(think=False, max_new_tokens=8)
  dialogues = run_dialogues(profiles, [0, 1], users, sampler=policy_sampler, params=params, chat=chat,
                            cfg=cfg, rng=jax.random.key(0))
  assert all(d.termination in ("max_turns", "goodbye", "emotion_zero", "emotion_full") for d in dialogues)
  assert all(1 <= len(d.policy_replies) <= 2 for d in dialogues)
  # Append-only: each row's cache holds exactly its token history, and the incremental cache gives
  # the same next-token logits as prefilling that history from scratch.
  lengths = np.asarray(backend.cache.lengths)
  assert [len(t) for t in backend.tokens] == lengths.tolist()
  fresh = Sampler(model, max_len=2048, stop_ids=chat.stop_ids, pad_id=chat.pad_id)
  cache, ref_logits = fresh.prefill(params, fresh.init_cache(2), backend.tokens)
  probe = [chat.encode("\n") for _ in range(2)]
  _, inc = backend.sampler.append(params, backend.cache, probe)
  _, full = fresh.append(params, cache, probe)
  np.testing.assert_allclose(np.asarray(inc), np.asarray(full), atol=2e-3, rtol=1e-4)
  # The history starts with this row's own system prompt.
  for b in range(2):
    text = chat.decode(backend.tokens[b][:400])
    assert profiles[b].player.split()[0] in text or profiles[b].player[:20] in text


def test_a_full_simulator_context_ends_only_that_dialogue(smol, tiny_policy):
  # A random 1-layer simulator never stops on its own, so each answer takes all 200 tokens and the
  # simulator's cache runs out after a few turns: those dialogues end as context_full (they used to
  # raise and end the whole run), with every recorded list consistent.
  _, chat = smol
  model, policy_sampler = tiny_policy
  profiles = load_demo_profiles()[:2]
  lengths = []
  for p in profiles:  # the first simulator prompt of each row, to size the cache just above it
    probe = SimulatedUsers([p], ScriptedBackend(), start_emotion=30)
    probe.opening()
    lengths.append(len(chat.conversation(probe.records[0].messages[:2], add_generation_prompt=True)))
  sim_sampler = Sampler(model, max_len=max(lengths) + 1200, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                        append_buckets=(64, 512))
  backend = ModelBackend(sim_sampler, nnx.state(model), chat, max_new_tokens=200,
                         sampling=SamplingParams.make(1.0), seed=0)
  users = SimulatedUsers(profiles, backend, start_emotion=30, max_turns=10, max_parse_retries=1)
  cfg = RolloutConfig(think=False, max_new_tokens=8)
  dialogues = run_dialogues(profiles, [0, 1], users, sampler=policy_sampler, params=nnx.state(model),
                            chat=chat, cfg=cfg, rng=jax.random.key(0))
  for b, d in enumerate(dialogues):
    assert d.termination == "context_full"
    assert 1 <= len(d.policy_replies) < 10
    assert len(d.emotions) == len(d.changes) + 1 == len(d.policy_replies) + 1
    assert backend.is_full(b) and len(backend.tokens[b]) <= sim_sampler.max_len
    assert int(np.asarray(backend.cache.lengths)[b]) == len(backend.tokens[b])
    assert d.reward == pytest.approx(max(d.final_emotion / 100, 0.0))


def test_turns_ended_by_another_stop_id_are_closed_with_im_end(smol, tiny_policy):
  # With every id a stop id each turn is one sampled token, mostly not <|im_end|> (as when a model
  # ends with <|endoftext|>): the template's <|im_end|> must still close each turn before the next
  # message, unmasked, in the policy's trajectory and in the simulator's cache.
  _, chat = smol
  model, _ = tiny_policy
  params = nnx.state(model)
  everything = list(range(model.config.vocab_size))
  policy = Sampler(model, max_len=1024, stop_ids=everything, pad_id=chat.pad_id, append_buckets=(64, 512))
  sim = Sampler(model, max_len=2048, stop_ids=everything, pad_id=chat.pad_id, append_buckets=(64, 512))
  backend = ModelBackend(sim, params, chat, max_new_tokens=8, sampling=SamplingParams.make(1.0), seed=0)
  profiles = load_demo_profiles()[:2]
  users = SimulatedUsers(profiles, backend, start_emotion=30, max_turns=3, max_parse_retries=0)
  dialogues = run_dialogues(profiles, [0, 1], users, sampler=policy, params=params, chat=chat,
                            cfg=RolloutConfig(think=False, max_new_tokens=8), rng=jax.random.key(0))
  closed_by_us = 0
  for d in dialogues:
    s = d.samples[0]
    for a, b in _spans(s.loss_mask):
      assert b - a == 1
      if s.tokens[a] != chat.im_end:
        assert s.tokens[b] == chat.im_end and s.loss_mask[b] == 0
        closed_by_us += 1
  assert closed_by_us > 0
  start = chat.tokenizer.convert_tokens_to_ids("<|im_start|>")
  for b in range(2):
    tokens = backend.tokens[b]
    # Every <|im_start|> after the first opens a message right after a closed one.
    for i in [i for i, t in enumerate(tokens) if t == start][1:]:
      assert tokens[i - 2:i] == [chat.im_end] + chat.encode("\n"), chat.decode(tokens[i - 4:i + 1])


def test_rollout_caches_are_padded_to_the_batch_shards(smol, tiny_policy):
  # 3 dialogues on 8 batch shards: an unpadded cache of 3 rows cannot be split over fsdp=8 and was
  # replicated (the whole cache on every device). Padded with inactive rows it is split, and the
  # dialogues are those of the single-device run.
  from jax.sharding import NamedSharding, PartitionSpec
  from rlver_jax.parallel.sharding import MeshConfig, make_mesh
  _, chat = smol
  model, _ = tiny_policy
  mesh = make_mesh(MeshConfig(fsdp=8))
  profiles = load_demo_profiles()[:3]
  cfg = RolloutConfig(think=False, max_new_tokens=6, temperature=0.0)
  out, seen = [], []
  for m in (None, mesh):
    params = nnx.state(model)
    if m is not None:
      params = jax.device_put(params, NamedSharding(m, PartitionSpec()))
    policy = Sampler(model, max_len=1024, stop_ids=chat.stop_ids, pad_id=chat.pad_id, mesh=m,
                     append_buckets=(64, 512))
    sim = Sampler(model, max_len=2048, stop_ids=chat.stop_ids, pad_id=chat.pad_id, mesh=m,
                  append_buckets=(64, 512))
    backend = ModelBackend(sim, params, chat, max_new_tokens=8, sampling=SamplingParams.make(0.0),
                           seed=0)
    allocate = policy.init_cache
    policy.init_cache = lambda rows: seen.append(rows) or allocate(rows)
    users = SimulatedUsers(profiles, backend, start_emotion=30, max_turns=2, max_parse_retries=0)
    with jax.set_mesh(m) if m is not None else _no_mesh():
      dialogues = run_dialogues(profiles, [0, 1, 2], users, sampler=policy, params=params,
                                chat=chat, cfg=cfg, rng=jax.random.key(0))
    out.append([(d.samples[0].tokens, d.user_lines) for d in dialogues])
    seen.append(backend.cache)
  assert seen[0] == 3 and seen[2] == 8  # the policy's cache rows
  assert seen[1].batch_size == 3 and seen[3].batch_size == 8  # the simulator's
  assert {s.data.shape[1] for s in seen[3].k.addressable_shards} == {1}  # one row per device
  assert out[0] == out[1]


class _no_mesh:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False
