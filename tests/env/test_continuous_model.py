"""Continuous batching (rollout.rows) with the co-located model simulator: on fewer cache rows than
dialogues, the policy's and the simulator's rows lent again as dialogues end, the dialogues and the
simulator's token histories equal those of the run with a row per dialogue (T=1, per-dialogue key
streams) and, greedy, today's lockstep rollout; with the reference information flow (rewinds), stop
rules, preset openings, no prefix sharing and the expected change."""
import dataclasses

import jax
import pytest
from flax import nnx

import forced_simulator
from continuous_world import GROUPS, Spy, make_sampler, same_dialogues
from rlver_jax.env.chat import policy_system_prompt
from rlver_jax.env.model_backend import ModelBackend
from rlver_jax.env.rollout import RolloutConfig, run_dialogues
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.models import load_pretrained
from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
from rlver_jax.sampling.sampler import Sampler
from rlver_jax.sampling.strategies import SamplingParams


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  from continuous_world import load_world
  return load_world(tmp_path_factory.mktemp("world"))


def _policy(world):
  """A policy sampler whose context fills after a few turns: dialogues end at different turns."""
  chat = world[1]
  prompt = chat.conversation([{"role": "system", "content": policy_system_prompt(False, "en")},
                              {"role": "user", "content": ""}], add_generation_prompt=True)
  return make_sampler(world, len(prompt) + 48)


def _model_run(world, rows, *, share_prefix=True, temperature=1.0, preset=False, **options):
  """`options`: info_flow (SimulatedUsers) and stop_at_lines (ModelBackend)."""
  model, chat, profiles = world
  if preset:  # group 1 opens with a preset first_talk (prefilled once, copied to its member)
    talk = dataclasses.replace(profiles[2], first_talk="I had a rough week.")
    profiles = [talk if g == 1 else p for g, p in zip(GROUPS, profiles)]
  params = nnx.state(model)
  sim = make_sampler(world, 2048, buckets=(256,))
  sim_spy = Spy(sim)
  backend = ModelBackend(sim, params, chat, max_new_tokens=8, seed=0, share_prefix=share_prefix,
                         sampling=SamplingParams.make(temperature), rows=rows,
                         stop_at_lines=options.pop("stop_at_lines", False))
  users = SimulatedUsers(profiles, backend, start_emotion=30, max_turns=5, max_parse_retries=1,
                         groups=GROUPS, **options)
  cfg = RolloutConfig(think=False, max_new_tokens=12, rows=rows, share_prefix=share_prefix,
                      temperature=temperature)
  dialogues = run_dialogues(profiles, GROUPS, users, sampler=_policy(world), params=params,
                            chat=chat, cfg=cfg, rng=jax.random.key(1))
  return dialogues, backend, sim_spy


def test_fewer_rows_give_the_same_dialogues_model_simulator(world):
  full, full_backend, _ = _model_run(world, rows=len(GROUPS))
  part, backend, spy = _model_run(world, rows=4)
  same_dialogues(full, part)  # 10 dialogues on 4 rows: rows were lent again
  assert len({len(d.policy_replies) for d in full}) > 1  # ended at different turns
  # The simulator's token histories (every prompt and every sampled answer) are the same too.
  assert backend.tokens == full_backend.tokens
  assert backend.prefill_tokens == full_backend.prefill_tokens
  assert backend.cache.batch_size == 4 and set(spy.batches) == {4} and max(spy.active) <= 4
  assert backend.slots.row_of == {}  # every row was given back


@pytest.mark.parametrize("temperature,reference_rows", [(1.0, len(GROUPS)), (0.0, 0)])
def test_lent_rows_with_rewinds_stop_rules_and_presets(world, temperature, reference_rows):
  # T=1 against the all-rows run; greedy against today's lockstep (rows=0, one key per call).
  options = dict(info_flow="reference", stop_at_lines=True, preset=True, temperature=temperature)
  want, want_backend, _ = _model_run(world, rows=reference_rows, **options)
  got, backend, _ = _model_run(world, rows=4, **options)
  same_dialogues(want, got)
  assert backend.tokens == want_backend.tokens
  assert want[2].user_lines[0] == want[3].user_lines[0] == "I had a rough week."


def test_lent_simulator_rows_without_prefix_sharing(world):
  # share_prefix=False re-prefills a member's copied prefix into its own (lent) row.
  shared, shared_backend, _ = _model_run(world, rows=4)
  fresh, backend, _ = _model_run(world, rows=4, share_prefix=False)
  same_dialogues(shared, fresh)
  assert backend.tokens == shared_backend.tokens
  assert backend.prefill_tokens > shared_backend.prefill_tokens


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
  """A simulator writing readable answers ("Change: +3"): the expected change is scored."""
  path = forced_simulator.make_simulator(tmp_path_factory.mktemp("sim"))
  model, _ = load_pretrained(path, dtype=jax.numpy.float32)
  return model, ChatTokens(load_tokenizer(path))


def _expected_run(world, forced, rows):
  model, chat, profiles = world
  sim_model, sim_chat = forced
  sim = Sampler(sim_model, max_len=2048, stop_ids=sim_chat.stop_ids, pad_id=sim_chat.pad_id,
                append_buckets=(64, 256, 1024))
  backend = ModelBackend(sim, nnx.state(sim_model), sim_chat, max_new_tokens=16, rows=rows,
                         sampling=SamplingParams.make(1.0))
  forced_simulator.force_answers(backend)
  users = SimulatedUsers(profiles[:4], backend, max_turns=2, groups=GROUPS[:4],
                         change_mode="expected", info_flow="reference")
  cfg = RolloutConfig(think=False, max_new_tokens=12, rows=rows, temperature=0.0)
  return run_dialogues(profiles[:4], GROUPS[:4], users, sampler=_policy(world),
                       params=nnx.state(model), chat=chat, cfg=cfg, rng=jax.random.key(2))


def test_expected_changes_on_lent_rows(world, forced):
  # 2 groups on 2 rows: the second group's rows are scored where the first group's were.
  lockstep = _expected_run(world, forced, rows=0)
  continuous = _expected_run(world, forced, rows=2)
  same_dialogues(lockstep, continuous, tol=1e-5)
  changes = [c for d in lockstep for c in d.changes]
  assert changes and all(c != round(c) for c in changes)  # means, not the written +3
  assert len(set(changes)) > 1
