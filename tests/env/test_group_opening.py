"""GRPO groups share their opening: the first row of a group generates the user's first line, the
other rows become copies of that dialogue state (records, backend contexts, simulator KV rows), with
the scripted-style fake, the HTTP backend and the co-located model backend."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from test_backends import _backend, stub  # noqa: F401 (stub is a fixture)

from rlver_jax.env.backends import HistoryBackend
from rlver_jax.env.model_backend import ModelBackend
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.env.rollout import RolloutConfig, run_dialogues
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.models.factory import create_model
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams


@pytest.fixture(scope="module")
def chat():
  from rlver_jax.models.embedded import embedded_model_dir
  return ChatTokens(load_tokenizer(embedded_model_dir()))


@pytest.fixture(scope="module")
def tiny(chat):
  """A 1-layer random model over SmolLM2's vocabulary: at T=1 two rows never sample the same text."""
  cfg = Qwen2Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=16, tie_word_embeddings=True, qkv_bias=False)
  return create_model(cfg, dtype=jnp.float32, seed=3, init_std=0.5)


def _grouped(preset: bool = False):
  """Two groups; with `preset`, the first one's profile has a preset first_talk."""
  demo = load_demo_profiles()
  a, b = (demo[3], demo[0]) if preset else demo[:2]
  assert bool(a.first_talk) == preset and not b.first_talk
  return [a, a, a, b, b], [0, 0, 0, 1, 1]


class _Counting(HistoryBackend):
  """Every answer is different (a call counter), so only copying can make two rows agree."""

  def __init__(self):
    super().__init__()
    self.calls = []

  def generate(self, requests):
    self._extend(requests)
    out = []
    for r in requests:
      self.calls.append((r.kind, r.row))
      text = "Change: +1" if r.kind in ("emotion", "retry") else f"Reply: line {len(self.calls)}"
      self._answer(r.row, text)
      out.append(text)
    return out


def test_members_get_the_leaders_opening_and_context():
  profiles, groups = _grouped()
  backend = _Counting()
  users = SimulatedUsers(profiles, backend, groups=groups)
  openings = users.opening()
  assert backend.calls == [("opening", 0), ("opening", 3)]
  assert openings == ["line 1"] * 3 + ["line 2"] * 2
  for row, lead in ((1, 0), (2, 0), (4, 3)):
    assert backend.history(row) == backend.history(lead)
    assert users.records[row].messages == users.records[lead].messages
  # From here on each member is its own dialogue: its next request carries only its own new messages.
  users.step([0, 1], ["thanks", "tell me more"])
  assert backend.history(0)[:3] == backend.history(1)[:3]
  assert backend.history(0)[3] != backend.history(1)[3]
  # Without groups every row generates its own opening.
  free = _Counting()
  assert len(set(SimulatedUsers(profiles, free).opening())) == 5


def test_group_members_must_share_their_profile():
  a, b = load_demo_profiles()[:2]
  with pytest.raises(ValueError, match="share group 0 but not their profile"):
    SimulatedUsers([a, b], _Counting(), groups=[0, 0])


def test_a_preset_first_talk_is_not_generated():
  import dataclasses
  a = dataclasses.replace(load_demo_profiles()[0], first_talk="I had a rough week.")
  backend = _Counting()
  users = SimulatedUsers([a, a], backend, groups=[0, 0])
  assert users.opening() == ["I had a rough week."] * 2 and backend.calls == []
  # The leader's context went to the backend at once (to be copied); the member got its copy.
  assert backend.history(0) == backend.history(1) == users.records[0].messages
  assert [m["role"] for m in backend.history(1)] == ["system", "user", "assistant"]
  assert users.records[1].sent == 3


@pytest.mark.parametrize("kv", ["float", "int8"])
def test_preset_opening_rows_after_copy_equal_rows_prefilled_one_by_one(chat, tiny, kv):
  # With an int8 cache too (simulator.kv_dtype): the copied rows carry their scales.
  from rlver_jax.env import simulator_prompts as prompts
  cache_dtype = jnp.int8 if kv == "int8" else None
  a = load_demo_profiles()[3]
  params = nnx.state(tiny)
  sim = Sampler(tiny, max_len=2048, stop_ids=chat.stop_ids, pad_id=chat.pad_id, append_buckets=(64, 512),
                cache_dtype=cache_dtype)
  backend = ModelBackend(sim, params, chat, max_new_tokens=12, sampling=SamplingParams.make(0.0))
  users = SimulatedUsers([a, a, a], backend, groups=[0, 0, 0])
  assert users.opening() == [a.first_talk] * 3
  prefix = (chat.message("system", prompts.system_prompt(a, "vanilla", "en"))
            + chat.message("user", prompts.opening_instruction("en", True))
            + chat.message("assistant", a.first_talk))
  assert backend.tokens == [prefix] * 3 and backend.prefill_tokens == len(prefix) > 200
  fresh = Sampler(tiny, max_len=2048, stop_ids=chat.stop_ids, pad_id=chat.pad_id, append_buckets=(64, 512),
                  cache_dtype=cache_dtype)
  cache, logits = fresh.prefill(params, fresh.init_cache(3), [prefix] * 3)
  probe = [chat.message("user", f"reply {b}") + chat.generation_header() for b in range(3)]
  copied, copied_logits = sim.append(params, backend.cache, probe, backend.logits)
  one_by_one, one_logits = fresh.append(params, cache, probe, logits)
  np.testing.assert_allclose(np.asarray(copied_logits), np.asarray(one_logits), atol=1e-5, rtol=1e-5)
  greedy = SamplingParams.make(0.0)
  x = sim.decode(params, copied, copied_logits, rng=jax.random.key(0), max_new_tokens=8, sampling=greedy)
  y = fresh.decode(params, one_by_one, one_logits, rng=jax.random.key(0), max_new_tokens=8,
                   sampling=greedy)
  assert [x.row(b) for b in range(3)] == [y.row(b) for b in range(3)]


def _policy(chat, model):
  return Sampler(model, max_len=1024, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                 append_buckets=(64, 512))


def test_http_backend_members_share_the_opening_token_for_token(stub, chat, tiny):  # noqa: F811
  def respond(n, body):
    last = body["messages"][-1]["content"]
    text = "Change: +2" if "Change" in last and "signed integer" in last else f"Reply: line {n}"
    return 200, {"choices": [{"message": {"role": "assistant", "content": text}}]}

  server, url = stub(respond)
  profiles, groups = _grouped()
  users = SimulatedUsers(profiles, _backend(url), max_turns=1, groups=groups)
  dialogues = run_dialogues(profiles, groups, users, sampler=_policy(chat, tiny),
                            params=nnx.state(tiny), chat=chat,
                            cfg=RolloutConfig(think=False, max_new_tokens=6),
                            rng=jax.random.key(0))
  openings = [s["body"]["messages"] for s in server.seen if len(s["body"]["messages"]) == 2]
  assert len(openings) == 2  # one opening request per group
  firsts = [d.user_lines[0] for d in dialogues]
  assert firsts[:3] == [firsts[0]] * 3 and firsts[3:] == [firsts[3]] * 2 and firsts[0] != firsts[3]
  for row, lead in ((1, 0), (2, 0), (4, 3)):
    mine, theirs = dialogues[row].samples[0], dialogues[lead].samples[0]
    prompt = mine.loss_mask.index(1)
    assert prompt == theirs.loss_mask.index(1)
    assert mine.tokens[:prompt] == theirs.tokens[:prompt]  # system prompt + the same opening ids
  # Each member's first emotion step was posted with the leader's context in front of its own reply.
  emotion_steps = [s["body"]["messages"] for s in server.seen if len(s["body"]["messages"]) == 4]
  assert len(emotion_steps) == 5
  by_profile = {}
  for m in emotion_steps:  # posted concurrently: in any order
    by_profile.setdefault(m[0]["content"], []).append(m)
  assert sorted(len(v) for v in by_profile.values()) == [2, 3]
  for steps in by_profile.values():
    assert all(m[:3] == steps[0][:3] for m in steps)


def test_model_backend_members_share_the_opening_token_for_token(chat, tiny):
  profiles, groups = _grouped()
  params = nnx.state(tiny)
  sim = Sampler(tiny, max_len=2048, stop_ids=chat.stop_ids, pad_id=chat.pad_id, append_buckets=(64, 512))
  out = {}
  for shared in (True, False):
    backend = ModelBackend(sim, params, chat, max_new_tokens=12, sampling=SamplingParams.make(1.0),
                           seed=0)
    users = SimulatedUsers(profiles, backend, max_turns=1, max_parse_retries=0,
                           groups=groups if shared else None)
    cloned = []  # each row's cached tokens when the opening is copied
    clone = backend.clone_rows
    backend.clone_rows = lambda src: cloned.append([list(t) for t in backend.tokens]) or clone(src)
    run_dialogues(profiles, groups, users, sampler=_policy(chat, tiny), params=params, chat=chat,
                  cfg=RolloutConfig(think=False, max_new_tokens=6), rng=jax.random.key(0))
    out[shared] = (users, backend, cloned)
  users, backend, [at_clone] = out[True]
  raw = [rec.messages[2]["content"] for rec in users.records]  # the opening as the simulator wrote it
  assert raw[:3] == [raw[0]] * 3 and raw[3:] == [raw[3]] * 2 and raw[0] != raw[3]
  for row, lead in ((1, 0), (2, 0), (4, 3)):
    assert at_clone[row] == []  # nothing was prefilled for a member: its prefix is the copy
    n = len(at_clone[lead])
    assert n > 200 and backend.tokens[row][:n] == backend.tokens[lead][:n] == at_clone[lead]
  # The copied cache rows hold exactly their token histories: the same next-token logits as a
  # fresh prefill of those histories.
  fresh = Sampler(tiny, max_len=2048, stop_ids=chat.stop_ids, pad_id=chat.pad_id, append_buckets=(64, 512))
  cache, _ = fresh.prefill(params, fresh.init_cache(5), backend.tokens)
  probe = [chat.encode("\n") for _ in range(5)]
  _, inc = sim.append(params, backend.cache, probe)
  _, full = fresh.append(params, cache, probe)
  np.testing.assert_allclose(np.asarray(inc), np.asarray(full), atol=2e-3, rtol=1e-4)
  # Control: without groups the same sampler gives every row its own opening.
  free, _, none = out[False]
  assert none == []
  assert len({rec.messages[2]["content"] for rec in free.records}) == 5


def test_copy_rows_keeps_the_cache_sharding(chat, tiny):
  from jax.sharding import NamedSharding, PartitionSpec
  from rlver_jax.parallel.sharding import MeshConfig, make_mesh
  mesh = make_mesh(MeshConfig(fsdp=8))
  params = jax.device_put(nnx.state(tiny), NamedSharding(mesh, PartitionSpec()))
  sampler = Sampler(tiny, max_len=256, stop_ids=chat.stop_ids, pad_id=chat.pad_id, mesh=mesh,
                    append_buckets=(64,))
  rows = [chat.encode(f"row {b} says hello") for b in range(8)]
  with jax.set_mesh(mesh):
    cache, logits = sampler.prefill(params, sampler.init_cache(8), rows)
    before = (cache.k.sharding, logits.sharding)
    want = np.asarray(logits)[[0, 1, 1, 3, 0, 5, 6, 7]]
    cache, logits = sampler.copy_rows(cache, logits, {2: 1, 4: 0})
  assert (cache.k.sharding, logits.sharding) == before
  np.testing.assert_array_equal(np.asarray(logits), want)
  assert np.asarray(cache.lengths).tolist() == [len(rows[b]) for b in (0, 1, 1, 3, 0, 5, 6, 7)]
  with pytest.raises(ValueError, match="both copied from and overwritten"):
    sampler.copy_rows(cache, logits, {2: 1, 1: 0})


def test_copied_policy_rows_equal_rows_prefilled_one_by_one(chat, tiny):
  from rlver_jax.env.chat import policy_system_prompt
  params = nnx.state(tiny)
  sampler = _policy(chat, tiny)
  prompt = chat.conversation([{"role": "system", "content": policy_system_prompt(True, "en")},
                              {"role": "user", "content": "My week was rough."}],
                             add_generation_prompt=True)
  other = chat.conversation([{"role": "user", "content": "Hello there."}], add_generation_prompt=True)
  one_by_one, one_logits = sampler.prefill(params, sampler.init_cache(3), [prompt, prompt, other])
  shared, shared_logits = sampler.prefill(params, sampler.init_cache(3), [prompt, [], other])
  shared, shared_logits = sampler.copy_rows(shared, shared_logits, {1: 0})
  np.testing.assert_allclose(np.asarray(shared_logits), np.asarray(one_logits), atol=1e-5, rtol=1e-5)
  greedy = SamplingParams.make(0.0)
  a = sampler.decode(params, one_by_one, one_logits, rng=jax.random.key(0), max_new_tokens=8,
                     sampling=greedy)
  b = sampler.decode(params, shared, shared_logits, rng=jax.random.key(0), max_new_tokens=8,
                     sampling=greedy)
  assert [a.row(r) for r in range(3)] == [b.row(r) for r in range(3)] and a.row(1) == a.row(0)


@pytest.mark.parametrize("preset,kv", [(False, "float"), (True, "float"), (True, "int8")])
def test_prefix_sharing_changes_only_the_prefill_count(chat, tiny, preset, kv):
  # Greedy policy and simulator: with and without sharing the dialogues are token for token the same;
  # with it, each member's policy prompt and simulator prefix (a generated or a preset opening) are
  # not prefilled again.
  from rlver_jax.env.rollout import RolloutStats
  profiles, groups = _grouped(preset)
  params = nnx.state(tiny)
  sim = Sampler(tiny, max_len=2048, stop_ids=chat.stop_ids, pad_id=chat.pad_id, append_buckets=(64, 512),
                cache_dtype=jnp.int8 if kv == "int8" else None)
  runs = {}
  for share in (True, False):
    backend = ModelBackend(sim, params, chat, max_new_tokens=12, sampling=SamplingParams.make(0.0),
                           seed=0, share_prefix=share)
    cloned = []
    clone = backend.clone_rows
    backend.clone_rows = lambda src: cloned.append([len(t) for t in backend.tokens]) or clone(src)
    users = SimulatedUsers(profiles, backend, max_turns=2, max_parse_retries=0, groups=groups)
    stats = RolloutStats()
    dialogues = run_dialogues(profiles, groups, users, sampler=_policy(chat, tiny), params=params,
                              chat=chat, rng=jax.random.key(0), stats=stats,
                              cfg=RolloutConfig(think=False, max_new_tokens=6, temperature=0.0,
                                                share_prefix=share))
    runs[share] = dict(samples=[d.samples[0] for d in dialogues], sim=[list(t) for t in backend.tokens],
                       policy=stats.policy_prefill_tokens, simulator=backend.prefill_tokens,
                       at_clone=cloned[0])
  on, off = runs[True], runs[False]
  assert [s.tokens for s in on["samples"]] == [s.tokens for s in off["samples"]]
  assert on["sim"] == off["sim"]
  members = ((1, 0), (2, 0), (4, 3))
  prompt = [s.loss_mask.index(1) for s in on["samples"]]  # system prompt + opening
  assert off["policy"] - on["policy"] == sum(prompt[m] for m, _ in members)
  assert off["simulator"] - on["simulator"] == sum(on["at_clone"][lead] for _, lead in members)
  assert min(prompt) > 50 and min(on["at_clone"][0], on["at_clone"][3]) > 200
