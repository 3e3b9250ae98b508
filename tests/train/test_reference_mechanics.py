"""The reference mechanics of docs/REPRODUCING.md that the plain configs change, each with its key:
the stated change range, the end at a high emotion, goodbye detection, the history limit, GRPO's
group statistics and profile sampling. Each test tells the two values of its key apart."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlver_jax.env import simulator_prompts as prompts
from rlver_jax.env.backends import HistoryBackend
from rlver_jax.env.chat import says_goodbye
from rlver_jax.env.profiles import ProfileSampler, load_demo_profiles
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.rl.advantages import grpo_advantages
from rlver_jax.rl.algorithms import GRPO
from rlver_jax.rl.pack import pack
from rlver_jax.spec import ConfigError, RunSpec

from config_files import load_config as _config


class _Scripted(HistoryBackend):
  """States `change` every emotion step; replies with the next of `lines` (then 'okay')."""

  def __init__(self, change: str, lines=()):
    super().__init__()
    self.change, self.lines = change, list(lines)

  def generate(self, requests):
    self._extend(requests)
    out = []
    for r in requests:
      if r.kind in ("emotion", "retry"):
        out.append(f"Change: {self.change}")
      else:
        out.append(f"Reply: {self.lines.pop(0) if self.lines else 'okay'}")
      self._answer(r.row, out[-1])
    return out


def _play(backend, **rules):
  users = SimulatedUsers(load_demo_profiles()[:1], backend, start_emotion=30, **rules)
  users.opening()
  while not users.done:
    users.step([0], ["I hear you."])
  return users.records[0]


# -- simulator.state_change_range -----------------------------------------------------------------


@pytest.mark.parametrize("language", ["en", "zh"])
def test_the_prompt_states_the_range_only_when_asked(language):
  stated = "-10 到 +10" if language == "zh" else "from -10 to +10"
  for text in (prompts.emotion_request(30, language, "vanilla"), prompts.retry_instruction(language)):
    assert stated in text
  for text in (prompts.emotion_request(30, language, "vanilla", change_range=0),
               prompts.retry_instruction(language, 0)):
    assert "10" not in text.replace("100", "")
  assert "-5 到 +5" in prompts.emotion_request(30, "zh", "vanilla", change_range=5)


def test_the_simulator_sends_the_configured_range():
  for change_range, stated in ((10, True), (0, False)):
    backend = _Scripted("+1")
    rec = _play(backend, max_turns=1, change_range=change_range, clamp_change=change_range > 0)
    sent = [m["content"] for m in backend.history(0) if m["role"] == "user"]
    assert ("-10 to +10" in sent[1]) == stated and rec.emotions == [30, 31]
  assert _config("grpo_think").simulator.state_change_range == 10
  assert _config("grpo_think", "reference").simulator.state_change_range == 0
  rules = RunSpec.from_config(_config("grpo_think", "reference")).simulator.user_rules()
  assert rules.change_range == 0


# -- simulator.end_above --------------------------------------------------------------------------


def test_training_ends_at_100_only_by_default():
  full = _play(_Scripted("+40"), max_turns=4, clamp_change=False)
  assert full.termination == "emotion_full" and full.emotions == [30, 70, 100]
  # Never ending high, the dialogue goes on at 100 until the budget (or a goodbye).
  on = _play(_Scripted("+40"), max_turns=4, clamp_change=False, end_above=0)
  assert on.termination == "max_turns" and on.emotions == [30, 70, 100, 100, 100]
  ref = RunSpec.from_config(_config("grpo_think", "reference"))
  assert ref.simulator.user_rules().end_above == 0
  assert ref.simulator.user_rules(ref.eval).end_above == 100  # evaluations keep the benchmark's end


# -- simulator.goodbye_match ----------------------------------------------------------------------


@pytest.mark.parametrize("text,language,clause,substring", [
    ("好的，拜拜", "zh", True, True),
    ("我再也不想再见到他了", "zh", False, True),
    ("那我们下次再见吧！", "zh", True, True),
    ("I said goodbye to him at the station.", "en", False, True),
    ("Thanks, bye!", "en", True, True),
    ("Take care.", "en", True, False),
])
def test_goodbye_matchers(text, language, clause, substring):
  assert says_goodbye(text, language, "clause") == clause
  assert says_goodbye(text, language, "substring") == substring


def test_the_simulator_ends_on_the_configured_goodbye_match():
  line = "我再也不想再见到他了"
  for match, termination in (("clause", "max_turns"), ("substring", "goodbye")):
    rec = _play(_Scripted("+0", [line] * 3), max_turns=3, goodbye_match=match,
                language_override="zh")
    assert rec.termination == termination
  assert _config("grpo_think", "reference").simulator.goodbye_match == "substring"


# -- simulator.history_chars ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
  """A random 1-layer model over SmolLM2's vocabulary: fast, and it never stops on its own."""
  from rlver_jax.models.embedded import embedded_model_dir
  from rlver_jax.models.factory import create_model
  from rlver_jax.models.presets import Qwen2Config
  from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
  chat = ChatTokens(load_tokenizer(embedded_model_dir()))
  cfg = Qwen2Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
  model = create_model(cfg, dtype=jnp.float32, seed=3, init_std=0.5)
  return model, chat


def _sampler(tiny, max_len=1024):
  from rlver_jax.sampling.sampler import Sampler
  model, chat = tiny
  return Sampler(model, max_len=max_len, stop_ids=chat.stop_ids, pad_id=chat.pad_id,
                 append_buckets=(64, 512))


def _run(tiny, users, profiles, **cfg):
  from flax import nnx
  from rlver_jax.env.rollout import RolloutConfig, run_dialogues
  model, chat = tiny
  return run_dialogues(profiles, list(range(len(profiles))), users, sampler=_sampler(tiny),
                       params=nnx.state(model), chat=chat, rng=jax.random.key(0),
                       cfg=RolloutConfig(think=False, max_new_tokens=6, **cfg))


def test_a_dialogue_past_the_history_limit_ends(tiny):
  from rlver_jax.env.backends import ScriptedBackend
  from rlver_jax.env.rollout import history_chars
  profiles = load_demo_profiles()[:2]
  ends = {}
  for limit in (0, 1):
    users = SimulatedUsers(profiles, ScriptedBackend(), start_emotion=30, max_turns=3)
    ends[limit] = [(d.termination, len(d.policy_replies))
                   for d in _run(tiny, users, profiles, history_chars=limit)]
    assert all(history_chars(rec) > 1 for rec in users.records)
  assert ends[1] == [("history_long", 1)] * 2 and ends[0] != ends[1]


def test_simulator_answers_cut_at_the_cap_are_counted(tiny):
  # The random simulator never closes an answer: every one is cut, and none has a change line.
  from flax import nnx
  from rlver_jax.env.model_backend import ModelBackend
  from rlver_jax.sampling.strategies import SamplingParams
  model, chat = tiny
  backend = ModelBackend(_sampler(tiny, 4096), nnx.state(model), chat, max_new_tokens=5,
                         sampling=SamplingParams.make(1.0, 1.0), seed=0)
  assert backend.cut_answers == 0 and HistoryBackend().cut_answers is None
  profiles = load_demo_profiles()[:1]
  users = SimulatedUsers(profiles, backend, start_emotion=30, max_turns=1, max_parse_retries=0)
  (d,) = _run(tiny, users, profiles)
  # Opening, one emotion step, no reply after max_turns: two answers cut; the change reads as 0.
  assert backend.cut_answers == 2 and d.parsed == [False] and d.emotions == [30, 30]


def test_history_limit_only_in_think_reference_training():
  assert _config("grpo_think").simulator.history_chars == 0
  assert _config("grpo_think", "reference").simulator.history_chars == 5000
  assert _config("grpo_nothink", "reference").simulator.history_chars == 0
  spec = RunSpec.from_config(_config("grpo_think", "reference"))
  assert spec.rollout_config().history_chars == 5000
  assert spec.rollout_config().history_measure == "rendered"
  assert spec.holdout_rollout_config().history_chars == 0
  assert RunSpec.from_config(_config("grpo_think")).rollout_config().history_measure == "visible"


def test_rendered_history_is_the_chat_template_text(tiny):
  # "rendered" counts what the reference counts: the policy's prompt as the ChatML template renders
  # it (the embedded tokenizer's own template is the reference here); "visible" the lines alone.
  from types import SimpleNamespace
  from rlver_jax.env.rollout import history_chars
  _, chat = tiny
  rec = SimpleNamespace(replies=["hi there", "我还是很难过。"], policy_replies=["hello, tell me more"])
  system = "You are a friend."
  messages = [{"role": "system", "content": system}, {"role": "user", "content": rec.replies[0]},
              {"role": "assistant", "content": rec.policy_replies[0]},
              {"role": "user", "content": rec.replies[1]}]
  rendered = chat.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert history_chars(rec, "rendered", system) == len(rendered) == 17 + 34 + 141  # tags: 30 + 2 x 28 + 33 + 22
  assert history_chars(rec, "visible", system) == 8 + 7 + 19 == 34


# -- rl.group_stats -------------------------------------------------------------------------------


def test_turn_rows_weigh_each_dialogue_by_its_rows():
  # One group: rewards 1.0 (3 rows) and 0.0 (1 row). Per dialogue: mean 0.5, std sqrt(0.5).
  # Per row: values 1, 1, 1, 0: mean 0.75, unbiased std sqrt((3 x 0.0625 + 0.5625) / 3) = 0.5.
  r, ids = jnp.array([1.0, 0.0]), jnp.array([0, 0])
  per_dialogue = np.asarray(grpo_advantages(r, ids))
  np.testing.assert_allclose(per_dialogue, [0.5 ** 0.5, -(0.5 ** 0.5)], rtol=1e-5)
  per_row = np.asarray(grpo_advantages(r, ids, weights=jnp.array([3.0, 1.0])))
  np.testing.assert_allclose(per_row, [0.5, -1.5], rtol=1e-5)


def _dialogue(reward, turns):
  sample = SimpleNamespace(tokens=[1, 2, 3], loss_mask=[0, 1, 1], sampler_logp=[0.0] * 3,
                           token_rewards={2: reward})
  return SimpleNamespace(reward=reward, group_id=0, samples=[sample] * turns)


def test_grpo_targets_follow_group_stats():
  dialogues = [_dialogue(1.0, 3), _dialogue(0.0, 1)]
  packed = pack(dialogues, micro_rows=1, pad_id=0)
  firsts = {}
  for stats in ("dialogue", "turn_rows"):
    target = GRPO(group_stats=stats).targets(dialogues, packed, None, None)
    firsts[stats] = (target.advantages[0, 1], target.advantages[3, 1])
    assert target.metrics["grpo/stat_rows_per_dialogue"] == (1.0 if stats == "dialogue" else 2.0)
  np.testing.assert_allclose(firsts["turn_rows"], [0.5, -1.5], rtol=1e-5)
  np.testing.assert_allclose(firsts["dialogue"], [0.5 ** 0.5, -(0.5 ** 0.5)], rtol=1e-5)
  assert RunSpec.from_config(_config("grpo_think", "reference")).algorithm.group_stats == "turn_rows"
  bad = _config("grpo_think", "reference")
  bad.rl.turn_credit = "all_turns"
  with pytest.raises(ConfigError, match="group_stats"):
    RunSpec.from_config(bad)


# -- data.sampling --------------------------------------------------------------------------------


def test_profile_sampling_with_and_without_replacement():
  profiles = load_demo_profiles()  # 8
  epochs = ProfileSampler(profiles, seed=0)
  first = [p.id for p in epochs.next_batch(8)]
  assert sorted(first) == sorted(p.id for p in profiles)  # each once per epoch
  drawn = ProfileSampler(profiles, seed=0, sampling="with_replacement")
  ids = [p.id for p in drawn.next_batch(40)]
  assert len(set(ids[:8])) < 8 or len(set(ids[8:16])) < 8  # repeats within a block of 8
  # Resumable: a sampler restored from the state continues the same draws.
  again = ProfileSampler(profiles, seed=0, sampling="with_replacement")
  again.next_batch(13)
  state = again.state_dict()
  restored = ProfileSampler(profiles, seed=0, sampling="with_replacement")
  restored.load_state_dict(state)
  assert [p.id for p in restored.next_batch(27)] == ids[13:]
  assert _config("grpo_think", "reference").data.sampling == "with_replacement"
  assert RunSpec.from_config(_config("grpo_think")).data.sampling == "epochs"


def test_reply_cut_reaches_the_rollouts():
  spec = RunSpec.from_config(_config("grpo_think", "reference"))
  assert spec.rollout_config().reply_cut == "reference"
  assert spec.holdout_rollout_config().reply_cut == "reference"
  assert RunSpec.from_config(_config("ppo_nothink")).rollout_config().reply_cut == "label"
