"""The simulator's information flow (`simulator.info_flow`): "reference" shows the emotion step a clean
transcript and the reply step only the fit/feeling notes and the state label, with each step's
private answers rewound out of the context; "chat" is today's one growing chat, bitwise."""
import copy
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from test_backends import _backend, stub  # noqa: F401 (stub is a fixture)

from rlver_jax.env import info_flow
from rlver_jax.env import simulator_prompts as prompts
from rlver_jax.env.backends import HistoryBackend, ScriptedBackend
from rlver_jax.env.model_backend import ModelBackend
from rlver_jax.env.parsing import labelled_sections
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.env.user_state import emotion_state
from rlver_jax.models.factory import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams

ANALYSIS = ("Meaning: m\nFit with my hidden theme: fits {n}\nInner reaction: ok\nFeeling: better\n"
            "Change: +{change}")


class _Scripted(HistoryBackend):
  """Answers by kind and call count (an unreadable analysis on every third call, a reply without a
  line on every fourth), and keeps a copy of the context each request was answered from."""

  def __init__(self):
    super().__init__()
    self.n, self.seen = 0, []

  def generate(self, requests):
    self._extend(requests)
    out = []
    for r in requests:
      self.n += 1
      self.seen.append((r.kind, r.row, copy.deepcopy(self._histories[r.row])))
      if r.kind == "emotion" and self.n % 3 == 0:
        text = "Meaning: unsure"
      elif r.kind in ("emotion", "retry"):
        text = ANALYSIS.format(n=self.n, change=self.n % 7)
      elif r.kind == "reply" and self.n % 4 == 0:
        text = "Plan: nothing"
      else:
        text = f"Plan: be short\nReply: line {self.n}"
      self._answer(r.row, text)
      out.append(text)
    return out


def _scenario(backend, turns=3, **kw):
  ps = load_demo_profiles()
  users = SimulatedUsers([ps[0], ps[0], ps[3], ps[3], ps[1]], backend, groups=[0, 0, 1, 1, 2],
                         max_turns=turns, **kw)
  users.opening()
  for t in range(turns):
    live = users.live_rows()
    users.step(live, [f"policy reply {t} row {r} I hear you" for r in live])
  return users


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# Computed with the code before the option existed (the same scenario; texts of every history).
CHAT_GOLDEN = "2d3afc27651eca7f142852b5450a91a91a74ee0d507b5b70c7c1b525a45f2fed"


@pytest.mark.parametrize("kw", [{}, {"info_flow": "chat"}])
def test_chat_flow_is_unchanged(kw):
  backend = _Scripted()
  users = _scenario(backend, **kw)
  got = ([backend.history(r) for r in range(5)] + [rec.replies for rec in users.records]
         + [rec.messages for rec in users.records])
  assert _digest(got) == CHAT_GOLDEN


def test_reading_keeps_only_the_fit_and_feeling_sections():
  en = ("1. **Meaning**: they care\n**Fit with my hidden theme:** it fits,\nthey listen\n"
        "Inner reaction: hidden\n- Feeling: better now. Change: +3\nChange: +3")
  assert info_flow.reading(en, "en") == ("Fit with my hidden theme: it fits,\nthey listen\n"
                                         "Feeling: better now.")
  zh = "对方的意思：关心我\n是否贴合隐藏主题：贴合\n内心反应：想哭\n感受：好多了\n变化：+2"
  assert info_flow.reading(zh, "zh") == "是否贴合隐藏主题：贴合\n感受：好多了"
  assert info_flow.reading("Feeling:\nChange: -2", "en") == ""  # an empty section is no reading
  assert info_flow.reading("I feel fine. Change: +1", "en") == ""
  assert info_flow.reading("Feeling: a\nFeeling: b\nChange: 0", "en") == "Feeling: b"  # the last one
  assert labelled_sections(None, ("Feeling",)) == {}
  # The labels the parser looks for are the ones the emotion step asks for.
  for lang, colon in (("en", ":"), ("zh", "：")):
    request = prompts.emotion_request(30, lang, "vanilla")
    assert all(f"{label}{colon}" in request for label in prompts.ANALYSIS_LABELS[lang])


def _contents(messages):
  return [m["content"] for m in messages]


def test_reference_flow_shows_the_clean_transcript_and_only_the_notes():
  backend = _Scripted()
  users = _scenario(backend, info_flow="reference")
  private = ("Meaning:", "Inner reaction", "Plan:", "Change:", "readable change line", "no line for")
  steps = [(k, r, c) for k, r, c in backend.seen if k in ("emotion", "reply")]
  assert len(steps) > 20
  for kind, row, context in steps:
    rec = users.records[row]
    # Before this step's request: the clean transcript (system, opening request, the opening line
    # alone, then each quoted policy reply and the user's visible line), nothing private.
    assert not any(p in c for c in _contents(context[2:-1]) for p in private), (kind, row)
    assert context[2] == {"role": "assistant", "content": rec.replies[0]}
    turn = (len(context) - 4) // 2  # 0-based policy turn of this step
    assert _contents(context[3:-1:2]) == [prompts.other_side_said(p, "en")
                                          for p in rec.policy_replies[:turn + 1]]
    assert _contents(context[4:-1:2]) == rec.replies[1:turn + 1]
    if kind == "emotion":
      assert context[-1]["content"] == prompts.emotion_request(rec.emotions[turn], "en", "vanilla")
    else:  # the state label and the fit/feeling notes of this turn's analysis; no number
      analysis = rec.reasoning[turn]
      state = emotion_state(rec.emotions[turn + 1])
      notes = info_flow.reading(analysis, "en")
      assert notes == analysis.splitlines()[1] + "\nFeeling: better"  # "Fit with my hidden theme: fits N"
      assert context[-1]["content"] == prompts.reference_reply_instruction(
          state, notes, "en", users._passive(rec))
      assert not any(ch.isdigit() for ch in prompts.reference_reply_instruction(state, "", "en", False))
  # The last context of a dialogue ended by the turn budget: the transcript and its last reply.
  rec = users.records[4]
  assert rec.termination == "max_turns" and len(rec.replies) == 3
  want = [prompts.system_prompt(rec.profile, "vanilla", "en"), prompts.opening_instruction("en", True),
          rec.replies[0]]
  for t in range(3):
    want += [prompts.other_side_said(rec.policy_replies[t], "en")] + rec.replies[t + 1:t + 2]
  assert _contents(backend.history(4)) == want
  # Retries happened (and were rewound with the rest); the record keeps every analysis.
  assert any(k == "retry" for k, _, _ in backend.seen) and any(k == "reply_retry" for k, _, _ in backend.seen)
  assert all(len(r.reasoning) == 3 and all(r.reasoning) for r in users.records)


def test_scripted_backend_ignores_the_option():
  runs = []
  for flow in ("chat", "reference"):
    backend = ScriptedBackend()
    users = _scenario(backend, info_flow=flow)
    runs.append(([backend.history(r) for r in range(5)],
                 [(rec.replies, rec.emotions, rec.reasoning) for rec in users.records]))
    assert users.info_flow == "chat"
  assert runs[0] == runs[1]


def test_unknown_flow_is_refused():
  with pytest.raises(ValueError, match="unknown info_flow 'plain'"):
    SimulatedUsers(load_demo_profiles()[:1], _Scripted(), info_flow="plain")


def test_http_backend_posts_the_same_messages(stub):  # noqa: F811
  def respond(n, body):
    last = body["messages"][-1]["content"]
    if "labelled sections" in last or "readable change line" in last:
      text = ANALYSIS.format(n=len(body["messages"]), change=len(body["messages"]) % 5)
    else:
      text = f"Plan: private\nReply: line {len(body['messages'])}"
    return 200, {"choices": [{"message": {"role": "assistant", "content": text}}]}

  class Same(_Scripted):  # the server's answers, from the messages alone
    def generate(self, requests):
      self._extend(requests)
      out = []
      for r in requests:
        self.seen.append((r.kind, r.row, copy.deepcopy(self._histories[r.row])))
        out.append(respond(0, {"messages": self._histories[r.row]})[1]["choices"][0]["message"]["content"])
        self._answer(r.row, out[-1])
      return out

  server, url = stub(respond)
  http_users = _scenario(_backend(url), turns=2, info_flow="reference")
  local = Same()
  local_users = _scenario(local, turns=2, info_flow="reference")
  posted = sorted(_digest(s["body"]["messages"]) for s in server.seen)
  assert posted == sorted(_digest(c) for _, _, c in local.seen)
  assert [r.replies for r in http_users.records] == [r.replies for r in local_users.records]


@pytest.fixture(scope="module")
def chat():
  from rlver_jax.models.embedded import embedded_model_dir
  return ChatTokens(load_tokenizer(embedded_model_dir()))


@pytest.fixture(scope="module")
def tiny():
  """Two random layers over SmolLM2's vocabulary (the second layer's keys depend on the context)."""
  cfg = Qwen2Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=16, tie_word_embeddings=True, qkv_bias=False)
  return create_model(cfg, dtype=jnp.float32, seed=3, init_std=0.5)


def _sim(chat, tiny, cache_dtype=None):
  return Sampler(tiny, max_len=2048, stop_ids=chat.stop_ids, pad_id=chat.pad_id, append_buckets=(64, 512),
                 cache_dtype=cache_dtype)


def _transcript_tokens(chat, messages):
  return [t for m in messages for t in chat.message(m["role"], m["content"])]


@pytest.mark.parametrize("kv", ["float", "int8"])
def test_model_cache_after_a_turn_is_a_fresh_prefill_of_the_transcript(chat, tiny, kv):
  # With an int8 cache too (simulator.kv_dtype): the rewinds leave the rows a fresh prefill would.
  cache_dtype = jnp.int8 if kv == "int8" else None
  params = nnx.state(tiny)
  sim = _sim(chat, tiny, cache_dtype)
  backend = ModelBackend(sim, params, chat, max_new_tokens=12, sampling=SamplingParams.make(1.0), seed=0)
  contexts = []  # per generate call: its request kind and each row's context when it decoded
  decode, generate = sim.decode, backend.generate
  sim.decode = lambda *a, **k: contexts[-1].append([list(t) for t in backend.tokens]) or decode(*a, **k)
  backend.generate = lambda requests: contexts.append([requests[0].kind]) or generate(requests)
  ps = load_demo_profiles()
  users = SimulatedUsers([ps[0], ps[0], ps[3]], backend, groups=[0, 0, 1], max_turns=3,
                         max_parse_retries=1, info_flow="reference")
  users.opening()
  for t in range(2):
    live = users.live_rows()
    assert live == [0, 1, 2]
    del contexts[:]
    users.step(live, [f"reply {t} of row {r}: I hear you" for r in live])
    for rec in users.records:
      clean = rec.messages[:rec.sent]
      assert backend.tokens[rec.row] == _transcript_tokens(chat, clean)
      assert _contents(clean[3::2]) == [prompts.other_side_said(p, "en") for p in rec.policy_replies]
      assert _contents(clean[4::2]) == rec.replies[1:-1]
    # The reply step's context: the transcript, then the reference reply request, nothing private.
    kinds = [c[0] for c in contexts]
    assert kinds == ["emotion", "retry", "reply", "reply_retry"]  # a random model: nothing parses
    reply_ctx = contexts[2][1]
    for rec in users.records:
      msgs = rec.messages[:rec.sent] + [info_flow.reply_message(
          "reference", rec.reasoning[-1], rec.emotion, rec.state, "en", users._passive(rec))]
      assert reply_ctx[rec.row] == _transcript_tokens(chat, msgs) + chat.generation_header()
  assert np.asarray(backend.cache.lengths)[:3].tolist() == [len(t) for t in backend.tokens]
  # The kept KV rows are those of a fresh prefill of the transcript: same keys/values, logits and
  # greedy continuation.
  fresh = _sim(chat, tiny, cache_dtype)
  cache, logits = fresh.prefill(params, fresh.init_cache(3), backend.tokens)
  for b, toks in enumerate(backend.tokens):
    np.testing.assert_allclose(np.asarray(backend.cache.k)[:, b, :, :len(toks)],
                               np.asarray(cache.k)[:, b, :, :len(toks)], atol=1e-5, rtol=1e-5)
    if kv == "int8":
      np.testing.assert_allclose(np.asarray(backend.cache.k_scale)[:, b, :, :len(toks)],
                                 np.asarray(cache.k_scale)[:, b, :, :len(toks)], rtol=1e-5)
  probe = [chat.message("assistant", "so") + chat.generation_header() for _ in range(3)]
  mine, mine_logits = sim.append(params, backend.cache, probe, backend.logits)
  theirs, their_logits = fresh.append(params, cache, probe, logits)
  np.testing.assert_allclose(np.asarray(mine_logits), np.asarray(their_logits), atol=1e-4, rtol=1e-4)
  greedy = SamplingParams.make(0.0)
  a = decode(params, mine, mine_logits, rng=jax.random.key(0), max_new_tokens=8, sampling=greedy)
  b = fresh.decode(params, theirs, their_logits, rng=jax.random.key(0), max_new_tokens=8, sampling=greedy)
  assert [a.row(r) for r in range(3)] == [b.row(r) for r in range(3)]


def test_model_backend_rewinds_only_to_message_ends(chat, tiny):
  backend = ModelBackend(_sim(chat, tiny), nnx.state(tiny), chat, max_new_tokens=4,
                         sampling=SamplingParams.make(1.0))
  backend.reset(1)
  backend.prefill({0: [{"role": "system", "content": "be brief"}]})
  from rlver_jax.env.backends import SimRequest
  req = SimRequest(row=0, new_messages=({"role": "user", "content": "hi"},), kind="opening",
                   profile=load_demo_profiles()[0], language="en")
  backend.generate([req])
  with pytest.raises(ValueError, match="cannot rewind to 3 messages"):
    backend.rewind({0: 3})  # inside the answer: it is closed only by the next request
  backend.rewind({0: 1})
  assert backend.tokens[0] == chat.message("system", "be brief") and backend.history(0) == [
      {"role": "system", "content": "be brief"}]
  assert int(np.asarray(backend.cache.lengths)[0]) == len(backend.tokens[0])
