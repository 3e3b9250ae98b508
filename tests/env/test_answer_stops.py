"""The simulator's answers end with their change / reply line: on real tokenizers the rules end
typical answers right after that line (parsing the kept text gives the whole answer's result), and
through the model backend a stopped decode equals the full one truncated (tokens, parse, cache)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlver_jax.env.answer_stops import (CHANGE_CONTENT, REPLY_CONTENT, AnswerStops, sequence_stops,
                                        token_classes)
from rlver_jax.env.backends import SimRequest
from rlver_jax.env.model_backend import ModelBackend
from rlver_jax.env.parsing import extract_reply, parse_change
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.models import embedded
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer, qwen25_tokenizer
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.stop_rules import LINE_BREAK
from rlver_jax.sampling.strategies import SamplingParams


def kept_by_line_rule(ids, gates, classes, bit) -> int:
  """Tokens the line rule keeps, by its definition (plain Python)."""
  armed = ready = False
  for t, tok in enumerate(ids):
    ready = ready or (armed and bool(classes[tok] & bit))
    if ready and classes[tok] & LINE_BREAK:
      return t + 1
    armed = armed or any(ids[: t + 1][-len(g):] == g for g in gates if len(g) <= t + 1)
  return len(ids)


ANSWERS = [  # (kind, whole answer, the parser)
    ("change", "Meaning: they listen.\nFeeling: a bit better\nChange: +3\n\nI hope that helps.", parse_change),
    ("change", "Inner reaction: hm\n**Change:** -4\nAnything else?", parse_change),
    ("change", "Feeling: fine\nchange:\n\n+5.\nThat is all", parse_change),
    ("change", "感受：好一些了\n变化：+3\n其他的话", parse_change),
    ("reply", "Plan: be short.\nReply: I'm fine, thanks.\nNote: private", extract_reply),
    ("reply", "Draft: x\nReply:\n\"Hi there!\"\nmore text", extract_reply),
    ("reply", "规划：简短\n回复：我没事，谢谢。\n备注：不要说", extract_reply),
]


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5"])
def chat(request):
  tok = qwen25_tokenizer() if request.param == "qwen2.5" else load_tokenizer(embedded.embedded_model_dir())
  return ChatTokens(tok)


def test_typical_answers_end_after_their_line(chat):
  stops = AnswerStops(chat, len(chat.tokenizer))
  for kind, text, parse in ANSWERS:
    ids = chat.encode(text)
    bit = CHANGE_CONTENT if kind == "change" else REPLY_CONTENT
    n = kept_by_line_rule(ids, stops.gates[kind], stops.classes, bit)
    kept = chat.decode(ids[:n])
    # It stopped at a line end, after the labelled line (the kept tokens are a prefix of the text).
    assert n < len(ids) and kept == text[: len(kept)] and kept.endswith("\n"), (text, kept)
    assert parse(kept) == parse(text) is not None, (text, kept)


def test_token_classes(chat):
  classes = token_classes(chat, len(chat.tokenizer) + 3)
  nl, dot_nl = chat.encode("\n"), chat.encode("ok.\n")[-1]
  assert classes[nl[0]] == LINE_BREAK  # a line break, no content
  assert classes[chat.encode("Hi")[0]] == CHANGE_CONTENT | REPLY_CONTENT
  assert classes[chat.encode("**")[0]] & (CHANGE_CONTENT | REPLY_CONTENT) == 0  # markdown is blank
  assert classes[dot_nl] & LINE_BREAK or chat.decode([dot_nl]) == "\n"
  assert (classes[-3:] == 0).all()  # ids past the tokenizer's vocabulary


# A word-level tokenizer and a model that is a chosen Markov chain over its words, so that answers
# are full of change and reply lines (a random model never writes one).
WORDS = ["Change", "Reply", ":", "+", "-", "3", "7", "hi", "ok", "\n", " ", "**"]
NEXT = {"\n": {"Change": 3, "Reply": 3, "hi": 2, "<|im_end|>": 0.5}, "Change": {":": 6}, "Reply": {":": 6},
        ":": {" ": 4, "\n": 1.5}, " ": {"+": 2, "-": 2, "hi": 2, "3": 1, "**": 1}, "+": {"3": 5, "7": 5},
        "-": {"3": 5, "7": 5}, "3": {"\n": 3}, "7": {"\n": 3, "3": 1}, "hi": {" ": 2, "\n": 2},
        "ok": {"\n": 3}, "**": {"hi": 2, "+": 2}, "assistant": {"\n": 8}}


@pytest.fixture(scope="module")
def markov(tmp_path_factory):
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  from rlver_jax.models import create_model
  from rlver_jax.models.presets import Qwen2Config

  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]", "system", "user", "assistant"]
  vocab = {t: i for i, t in enumerate(specials + WORDS)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\*\*|[:+\-\n ]|[0-9]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
  fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
  V, D = len(vocab), 32
  cfg = Qwen2Config(vocab_size=V, hidden_size=D, intermediate_size=16, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=16, tie_word_embeddings=False, qkv_bias=True,
                    eos_token_id=vocab["<|im_end|>"], pad_token_id=0)
  model = create_model(cfg, dtype=jnp.float32, seed=0)
  # No layer writes to the residual stream, so the logits are lm_head(norm(embed(last token))).
  model.layers.wo[...] = jnp.zeros_like(model.layers.wo[...])
  model.layers.w_down[...] = jnp.zeros_like(model.layers.w_down[...])
  model.embed[...] = jnp.eye(V, D)
  logits = np.full((V, V), -3.0, np.float32)  # off the listed transitions: rare
  logits[:, [vocab[s] for s in specials if s != "<|im_end|>"]] = -30
  for a, nexts in NEXT.items():
    for b, w in nexts.items():
      logits[vocab[a], vocab[b]] = w
  head = np.zeros((D, V), np.float32)
  head[:V] = logits / np.sqrt(D)  # the norm scales a one-hot row to sqrt(D)
  model.lm_head[...] = jnp.asarray(head)
  return model, ChatTokens(fast)


def _backend(model, chat, stop):
  sampler = Sampler(model, max_len=256, stop_ids=chat.stop_ids, pad_id=chat.pad_id, append_buckets=(16, 64))
  return ModelBackend(sampler, nnx.state(model), chat, max_new_tokens=48,
                      sampling=SamplingParams.make(1.0), seed=7, stop_at_lines=stop)


def test_backend_stop_equals_the_full_answer_truncated(markov):
  model, chat = markov
  profile = load_demo_profiles()[0]
  kinds = ["emotion", "reply", "retry", "reply_retry", "opening", "emotion", "reply", "emotion"] * 2
  requests = [SimRequest(row=b, new_messages=({"role": "user", "content": "hi"},), kind=k,
                         profile=profile, language="en") for b, k in enumerate(kinds)]
  full, stopped = _backend(model, chat, False), _backend(model, chat, True)
  for b in (full, stopped):
    b.reset(len(kinds))
  texts_full, texts_stop = full.generate(requests), stopped.generate(requests)
  early = same_as_whole = 0
  for b, kind in enumerate(kinds):
    mine, whole = stopped.tokens[b], full.tokens[b]
    assert whole[: len(mine)] == mine  # the same tokens, cut
    parse = parse_change if kind in ("emotion", "retry") else extract_reply
    if len(mine) < len(whole):
      early += 1
      rest = chat.decode(whole[len(mine):])
      label = "Change" if parse is parse_change else "Reply"
      if label not in rest:  # nothing after the kept line could have overruled it
        same_as_whole += 1
        assert parse(texts_stop[b]) == parse(texts_full[b]), (texts_stop[b], texts_full[b])
    else:
      assert texts_stop[b] == texts_full[b]
  assert early >= 6 and same_as_whole >= 3, (early, same_as_whole)
  # Token-in/token-out: each row's cache holds exactly its recorded tokens; a turn ended by a rule
  # is closed with <|im_end|> on the next call.
  assert np.asarray(stopped.cache.lengths)[: len(kinds)].tolist() == [len(t) for t in stopped.tokens]
  cut_rows = [b for b in range(len(kinds)) if len(stopped.tokens[b]) < len(full.tokens[b])]
  before = len(stopped.tokens[cut_rows[0]])
  stopped.generate([SimRequest(row=cut_rows[0], new_messages=({"role": "user", "content": "ok"},),
                               kind="emotion", profile=profile, language="en")])
  assert stopped.tokens[cut_rows[0]][before] == chat.im_end


def test_policy_stop_strings(markov):
  _, chat = markov
  rules = sequence_stops(chat, ["<|im_start|>", "hi ok"], rows=3, vocab_size=len(chat.tokenizer))
  assert rules.seqs.shape[:1] == (3,)
  assert rules.seqs[0, 0, -1] == chat.im_start
  assert rules.seqs[2, 1, -3:].tolist() == chat.encode("hi ok")
  assert sequence_stops(chat, [], rows=3, vocab_size=10) is None


def test_policy_turn_ends_at_its_stop_string(markov):
  """A policy turn stopped at "hi" equals the plain turn cut after its first "hi" (tokens, log-probs),
  and is closed with <|im_end|> (not sampled) like a turn cut by its budget."""
  from rlver_jax.env.backends import ScriptedBackend
  from rlver_jax.env.rollout import RolloutConfig, run_dialogues
  from rlver_jax.env.simulator import SimulatedUsers
  model, chat = markov
  profiles = load_demo_profiles()[:4]
  sampler = Sampler(model, max_len=512, stop_ids=chat.stop_ids, pad_id=chat.pad_id, append_buckets=(64, 512))
  hi = chat.encode("hi")[0]
  turns = {}
  for stops in ((), ("hi",)):
    users = SimulatedUsers(profiles, ScriptedBackend(), start_emotion=30, max_turns=1)
    cfg = RolloutConfig(think=False, max_new_tokens=24, stop_sequences=stops)
    dialogues = run_dialogues(profiles, [0, 1, 2, 3], users, sampler=sampler, params=nnx.state(model),
                              chat=chat, cfg=cfg, rng=jax.random.key(2))
    turns[stops] = [(np.asarray(d.samples[0].tokens), np.asarray(d.samples[0].loss_mask),
                     np.asarray(d.samples[0].sampler_logp)) for d in dialogues]
  cut = 0
  for (tok, mask, logp), (tok_s, mask_s, logp_s) in zip(turns[()], turns[("hi",)]):
    gen, gen_s = tok[mask == 1].tolist(), tok_s[mask_s == 1].tolist()
    n = gen.index(hi) + 1 if hi in gen else len(gen)
    cut += n < len(gen)
    assert gen_s == gen[:n]
    np.testing.assert_array_equal(logp_s[mask_s == 1], logp[mask == 1][:n])
    start = int(np.argmax(mask_s))
    assert tok_s[start + n] == chat.im_end and mask_s[start + n] == 0 or gen_s[-1] == chat.im_end
  assert cut >= 2, cut
