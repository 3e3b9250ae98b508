"""simulator.change_mode="expected": the applied change equals a hand computation from the simulator's
own logits over the candidate values (full forwards of prefix + candidate, no cache); "sampled" is
the old path bitwise; backends without a distribution are refused naming simulator.change_mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import forced_simulator
from rlver_jax.env.backends import OpenAIChatBackend, ScriptedBackend
from rlver_jax.env.expected_change import expected_value, split_at, value_forms
from rlver_jax.env.model_backend import ModelBackend
from rlver_jax.env.parsing import change_value_offset, parse_change
from rlver_jax.env.profiles import Profile
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.models import load_pretrained
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams
from rlver_jax.spec import ConfigError, SimulatorSpec

PROFILE = Profile(id="p0", player="Sam, 30, a baker.", scene="Sam's shop is failing.",
                  main_cha="negative", cha_group=("anxious",), task="You want practical advice.")
REPLIES = ["Try one small step today.", "What would help most right now?"]


def test_value_offset_points_at_the_value_parse_change_reads():
  for text, value in [("Change: +3", "+3"), ("x\n**Change:** -10 points", "-10 points"),
                      ("Change: 2\nlater: Change:\n\n  “+4”", "+4”"), ("变化：＋5", "＋5"),
                      ("Change +7", "+7"), ("Change: none.", "none.")]:
    offset = change_value_offset(text)
    assert text[offset:] == value
    assert parse_change(text[:offset] + text[offset:]) == parse_change(text)
  assert change_value_offset("no label here") is None and change_value_offset(None) is None


def test_value_forms_and_mean():
  assert value_forms(3) == ("+3", "3") and value_forms(-4) == ("-4",)
  assert value_forms(0) == ("0", "+0", "-0")
  assert all(parse_change(f"Change: {f}") == v for v in range(-10, 11) for f in value_forms(v))
  # weights 1, 3 over values -2 and 2: mean (-2 + 6) / 4 = 1
  assert expected_value({-2: np.log(1.0), 2: np.log(3.0), 5: -np.inf}) == pytest.approx(1.0)
  assert expected_value({1: -np.inf}) is None


@pytest.fixture(scope="module")
def simulator_dir(tmp_path_factory):
  return forced_simulator.make_simulator(tmp_path_factory.mktemp("sim"))


@pytest.fixture(scope="module")
def loaded(simulator_dir):
  model, _ = load_pretrained(simulator_dir, dtype=jnp.float32)
  return model, ChatTokens(load_tokenizer(simulator_dir))


def test_split_at_byte_level_tokens(loaded):
  _, chat = loaded
  for head, value in [("Change:", " +3"), ("Change:", "+3"), ("**Change:**", " -10")]:
    ids = chat.encode(head + value)
    text = chat.decode(ids)
    k, gap = split_at(chat, ids, change_value_offset(text))
    assert chat.decode(ids[:k]) + gap + value.lstrip() == text
    assert gap.strip() == "" or head.endswith(gap)


def _users(loaded, change_mode=None, rows=2):
  model, chat = loaded
  sampler = Sampler(model, max_len=2048, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                    append_buckets=(64, 128, 256, 512, 1024))
  backend = ModelBackend(sampler, nnx.state(model), chat,
                         max_new_tokens=16, sampling=SamplingParams.make(0.7, 0.9, 0))
  forced_simulator.force_answers(backend)
  kw = {} if change_mode is None else {"change_mode": change_mode}
  return SimulatedUsers([PROFILE] * rows, backend, max_turns=3, **kw), backend


def _hand_expected(model, chat, tokens):
  """The mean change from full forwards of the analysis prefix + every form (no cache)."""
  answer = chat.encode(forced_simulator.ANALYSIS) + [chat.im_end]
  at = max(i for i in range(len(tokens)) if tokens[i:i + len(answer)] == answer)
  head = chat.encode(forced_simulator.ANALYSIS_HEAD)
  assert head + chat.encode(" +3") + [chat.im_end] == answer  # the value starts after "Change:"
  prefix = tokens[:at] + head
  vocab = chat.tokenizer.get_vocab()
  digits = [i for t, i in vocab.items() if t[:1].isdigit()]
  forms = [(v, chat.encode(" " + f)) for v in range(-10, 11) for f in value_forms(v)]
  L = len(prefix) + max(len(ids) for _, ids in forms)
  batch = np.full((len(forms), L), chat.pad_id, np.int32)
  for j, (_, ids) in enumerate(forms):
    batch[j, :len(prefix) + len(ids)] = prefix + ids
  n = len(prefix)
  hidden = model.hidden_states(jnp.asarray(batch))[:, n - 1:]  # logits only where the forms are read
  logp = np.asarray(jax.nn.log_softmax(model.logits(hidden), axis=-1), np.float64)
  mass = {}
  for j, (v, ids) in enumerate(forms):
    lp = sum(logp[j, i, t] for i, t in enumerate(ids))
    lp += np.log1p(-np.exp(logp[j, len(ids), digits]).sum())
    mass[v] = mass.get(v, 0.0) + np.exp(lp)
  total = sum(mass.values())
  return sum(v * m for v, m in mass.items()) / total


def test_expected_change_equals_hand_computation(loaded):
  model, chat = loaded
  users, backend = _users(loaded, "expected")
  users.opening()
  results = users.step([0, 1], REPLIES)
  for r, reply in zip(results, REPLIES):
    # Only the emotion-step answer's cached tokens matter: the reply step came after it.
    want = _hand_expected(model, chat, backend.tokens[r.row])
    # fp32: the cached and the full forward round differently (~1e-5 on log-probs near -25).
    assert r.parsed and r.change == pytest.approx(want, abs=2e-4)
    assert r.change != round(r.change)  # a mean, not one of the values
    assert r.emotion == 30 + r.change
    rec = users.records[r.row]
    assert rec.reward == (30 + r.change) / 100 and rec.turn_rewards == pytest.approx([r.change / 100])
    assert rec.reasoning[-1] == forced_simulator.ANALYSIS  # the written value stays the sampled one
    # The reply step is told the emotion after the expected change, to one decimal.
    assert f"Your emotion is now {round(r.emotion, 1)}" in rec.messages[-2]["content"]
  assert results[0].change != pytest.approx(results[1].change)  # other replies, other means


def test_sampled_mode_is_the_default_path(loaded, monkeypatch):
  monkeypatch.setattr(ModelBackend, "expected_changes",
                      lambda *a: pytest.fail("sampled mode must not score the change values"))
  runs = []
  for mode in (None, "sampled"):
    users, _ = _users(loaded, mode)
    users.opening()
    users.step([0, 1], REPLIES)
    runs.append(users.records)
  for a, b in zip(*runs):
    assert a.changes == b.changes == [3] and a.emotions == b.emotions == [30, 33]
    assert type(a.emotion) is int and a.messages == b.messages


def test_backends_without_a_distribution_are_refused():
  for backend in (ScriptedBackend(), OpenAIChatBackend("http://localhost:1/v1", "m")):
    with pytest.raises(ValueError, match=r"simulator.change_mode='expected' needs the co-located "
                                         r"model backend \(simulator.backend='model'\)"):
      SimulatedUsers([PROFILE], backend, change_mode="expected")
  with pytest.raises(ValueError, match=r"simulator.change_mode='mean': must be one of"):
    SimulatedUsers([PROFILE], ScriptedBackend(), change_mode="mean")


def test_spec_refuses_expected_without_the_model_backend():
  for backend, extra in (("scripted", {}), ("http", {"http_base_url": "http://h/v1", "http_model": "m"})):
    with pytest.raises(ConfigError, match=rf"^config.simulator.change_mode='expected': must be "
                                          rf"'sampled' with simulator.backend='{backend}'"):
      SimulatorSpec(backend=backend, change_mode="expected", **extra)
  with pytest.raises(ConfigError, match=r"config.simulator.change_mode='mean': must be one of"):
    SimulatorSpec(change_mode="mean")
  assert SimulatorSpec(change_mode="expected").change_mode == "expected"
