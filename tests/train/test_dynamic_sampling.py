"""Dynamic sampling: which groups a step trains on over its rounds (hand-made rounds), and one real
training step on the tiny world (refill from the data stream, batch shape, metrics, resume)."""
import json
import pathlib

import jax
import numpy as np
import pytest

import tiny_world
from rlver_jax.env.profiles import ProfileSampler, load_profiles, split_holdout
from rlver_jax.env.rollout import Dialogue, RolloutStats, Sample
from rlver_jax.rl.algorithms import GRPO
from rlver_jax.rl.batch import packed_rows
from rlver_jax.spec import RunSpec
from rlver_jax.train import loop as train
from rlver_jax.train.trainer import Trainer
from rlver_jax.train.dynamic_sampling import Round, fill_informative


def _dialogue(group: int, reward: float) -> Dialogue:
  sample = Sample(0, [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [2])
  return Dialogue(row=0, profile=None, group_id=group, samples=[sample], policy_raw=[],
                  policy_replies=[], policy_thoughts=[], format_ok=[], user_lines=[],
                  emotions=[30, int(reward * 100)], changes=[], reasoning=[], termination="max_turns",
                  parse_failures=0, reward=reward)


def _round(*groups: tuple[float, ...]) -> Round:
  """A round whose group g has the rewards groups[g]."""
  ds = [_dialogue(g, r) for g, rewards in enumerate(groups) for r in rewards]
  return Round(ds, ds, RolloutStats(policy_tokens=10, policy_turns=len(ds)))


def _rounds(*rounds: Round):
  asked = []

  def more(r):
    asked.append(r)
    return rounds[r - 1]
  return more, asked


def test_a_step_whose_groups_all_carry_a_signal_trains_its_first_round_as_is():
  first = _round((0.3, 0.4), (0.5, 0.2))
  more, asked = _rounds()
  out = fill_informative(first, more, GRPO().informative_groups, groups=2, max_rounds=2)
  assert asked == [] and out.trained == first.trained and out.dialogues == first.dialogues
  assert all(a is b for a, b in zip(out.trained, first.trained))  # the same objects: same batch
  assert out.metrics["dynamic_sampling/dropped_groups"] == 0
  assert out.metrics["dynamic_sampling/extra_rounds"] == 0
  assert out.metrics["dynamic_sampling/short"] == 0


def test_equal_reward_groups_are_replaced_by_the_next_rounds_informative_ones():
  first = _round((0.3, 0.3), (0.5, 0.2))           # group 0 ties: dropped
  second = _round((0.4, 0.4), (0.1, 0.6))          # group 0 ties again, group 1 fills the slot
  more, asked = _rounds(second, _round((0.2, 0.9), (0.2, 0.9)))
  out = fill_informative(first, more, GRPO().informative_groups, groups=2, max_rounds=2)
  assert asked == [1]  # full after one extra round
  assert [(d.group_id, d.reward) for d in out.trained] == [(0, 0.5), (0, 0.2), (1, 0.1), (1, 0.6)]
  # Every rolled-out dialogue is kept for transcripts, round r's groups numbered from r x 2.
  assert [d.group_id for d in out.dialogues] == [0, 0, 1, 1, 2, 2, 3, 3]
  m = out.metrics
  assert (m["dynamic_sampling/dropped_groups"], m["dynamic_sampling/extra_rounds"],
          m["dynamic_sampling/extra_dialogues"], m["dynamic_sampling/short"]) == (2, 1, 4, 0)
  assert m["dynamic_sampling/trained_reward_mean"] == pytest.approx(0.35)
  assert out.stats.policy_tokens == 20 and out.stats.policy_turns == 8


def test_a_batch_still_short_after_the_last_round_is_padded_with_dropped_groups_at_zero_weight():
  first = _round((0.3, 0.3), (0.5, 0.5), (0.2, 0.6))
  more, asked = _rounds(_round((0.4, 0.4), (0.7, 0.1), (0.1, 0.1)))
  out = fill_informative(first, more, GRPO().informative_groups, groups=3, max_rounds=1)
  assert asked == [1]
  assert [(d.group_id, d.reward) for d in out.trained] == [
      (0, 0.2), (0, 0.6), (1, 0.7), (1, 0.1), (2, 0.3), (2, 0.3)]
  masks = [s.loss_mask for d in out.trained for s in d.samples]
  assert masks == [[0, 1, 1]] * 4 + [[0, 0, 0]] * 2  # the padding group carries no loss weight
  assert first.trained[0].samples[0].loss_mask == [0, 1, 1]  # the rollout's own samples untouched
  m = out.metrics
  assert (m["dynamic_sampling/informative_groups"], m["dynamic_sampling/padded_groups"],
          m["dynamic_sampling/dropped_groups"], m["dynamic_sampling/short"]) == (2, 1, 4, 1)


def test_surplus_informative_groups_are_counted_and_not_trained():
  first = _round((0.3, 0.3), (0.5, 0.2))
  more, _ = _rounds(_round((0.4, 0.1), (0.1, 0.6)))
  out = fill_informative(first, more, GRPO().informative_groups, groups=2, max_rounds=3)
  assert len(out.trained) == 4 and out.metrics["dynamic_sampling/surplus_groups"] == 1


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


def _metrics(workdir):
  return [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def test_one_training_step_refills_from_the_data_stream_and_resumes_like_a_straight_run(
    world, tmp_path, monkeypatch):
  # The tiny policy's groups of 8 rarely tie, so the first round's group 0 is declared empty of
  # signal: the step must roll out one more round (the next 2 profiles) and train group 0 of it.
  real = GRPO.informative_groups
  calls = []

  def first_round_loses_group_0(self, dialogues):
    calls.append(len(calls))
    found = real(self, dialogues)
    return found - {0} if len(calls) % 2 == 1 else found
  monkeypatch.setattr(GRPO, "informative_groups", first_round_loses_group_0)
  cfg = lambda steps: tiny_world.training_config(
      world, "grpo", total_steps=steps, **{"rl.dynamic_sampling": True,
                                           "rl.dynamic_sampling_max_rounds": 1,
                                           "log.transcripts_every": 1})
  shapes = []
  make_batch = Trainer.make_batch

  def recording(self, dialogues):
    out = make_batch(self, dialogues)
    shapes.append(out[0].tokens.shape)
    return out
  monkeypatch.setattr(Trainer, "make_batch", recording)
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  train.run(RunSpec.from_config(cfg(2)), str(straight))
  m = _metrics(straight)
  for row in m:
    assert (row["dynamic_sampling/extra_rounds"], row["dynamic_sampling/extra_dialogues"],
            row["dynamic_sampling/dropped_groups"], row["dynamic_sampling/short"]) == (1, 16, 1, 0)
    assert row["samples"] == 16 and np.isfinite(row["loss"])
  # Each step's transcripts hold both rounds; round 1 rolled out the stream's next two profiles.
  stream = ProfileSampler(split_holdout(load_profiles(world["profiles"]), 0, 0)[0], seed=0)
  step1 = [json.loads(l) for l in (straight / "transcripts/step_000001.jsonl").read_text().splitlines()]
  assert [d["profile_id"] for d in step1[::8]] == [p.id for p in stream.next_batch(4)]
  assert sorted({d["group_id"] for d in step1}) == [0, 1, 2, 3]
  # A full batch has a plain step's rows (16 samples): the update compiles nothing new for it.
  spec = RunSpec.from_config(cfg(2))
  rows = packed_rows(16, spec.rl.micro_batch_size * jax.device_count(), 1, spec.rl.rows_per_mini_batch)  # fsdp over all
  assert [s[0] * s[1] for s in shapes] == [rows, rows]

  calls.clear()
  train.run(RunSpec.from_config(cfg(1)), str(resumed))
  train.run(RunSpec.from_config(cfg(2)), str(resumed))
  assert [r["reward_mean"] for r in m] == [r["reward_mean"] for r in _metrics(resumed)]
  assert ((straight / "transcripts/step_000002.jsonl").read_text()
          == (resumed / "transcripts/step_000002.jsonl").read_text())
