"""The held-out evaluation during training: the current policy on the profiles kept out of training,
with the benchmark's rules (config.eval), written into the step's metrics row and TensorBoard."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax

from rlver_jax.build import RunParts
from rlver_jax.env.profiles import Profile
from rlver_jax.env.rollout import Dialogue, run_dialogues
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.evaluation.scoring import check_no_simulator_errors, dialogue_markdown, summarize
from rlver_jax.run.metrics import MetricsWriter
from rlver_jax.spec import RunSpec
from rlver_jax.train.trainer import reseed_simulator

_EVAL_SEED_OFFSET = 7  # the evaluation's key, apart from the training rollouts'


def evaluate_holdout(spec: RunSpec, parts: RunParts, params, profiles: Sequence[Profile], rng,
                     should_stop=None) -> tuple[dict, list[Dialogue]]:
  """The policy `params` (its rollout copy) on the held-out `profiles`, through the run's sampler
  and simulator backend, with the evaluation's users (config.eval): (eval/* metrics, the
  dialogues). `should_stop` is polled between turns (RolloutInterrupted when it fires)."""
  e, s = spec.eval, spec.simulator
  profiles = list(profiles)[: e.num_profiles or None]  # 0 = all, as in the eval config
  reseed_simulator(parts.backend, rng)
  # The evaluation's change rules (config.eval), the change as sampled, whatever training reads.
  rules = dataclasses.replace(s.user_rules(e), change_mode="sampled")
  users = SimulatedUsers.playing(profiles, parts.backend, rules)
  with jax.set_mesh(parts.mesh):
    dialogues = run_dialogues(profiles, list(range(len(profiles))), users, sampler=parts.sampler,
                              params=params, chat=parts.chat, cfg=spec.holdout_rollout_config(),
                              rng=rng, should_stop=should_stop)
  check_no_simulator_errors(dialogues, parts.backend, "held-out evaluation")
  summary = summarize(dialogues)
  scores = {f"eval/{k}": summary[k] for k in ("score", "success_rate", "failure_rate", "mean_turns")}
  return scores, dialogues


def write_evaluation(writer: MetricsWriter, step: int, scores: dict, dialogues: list[Dialogue]) -> str:
  """Adds the held-out evaluation to the step's metrics row and to TensorBoard (each dialogue as
  text under eval/dialogue/PROFILE, the emotion trajectories as an image); returns a one-line
  summary."""
  from rlver_jax.evaluation.sentient import plot_trajectories  # matplotlib, only when evaluating
  writer.write(step, scores, merge=True)
  texts = {f"eval/dialogue/{d.profile.id}": dialogue_markdown(d) for d in dialogues}
  title = f"step {step}: held-out score {scores['eval/score']:.1f}"
  writer.write_board_media(step, texts,
                           {"eval/emotion_trajectories": plot_trajectories(dialogues, title)})
  return (f"step {step} held-out evaluation: score {scores['eval/score']:.1f}, success "
          f"{scores['eval/success_rate']:.0%}, failure {scores['eval/failure_rate']:.0%}, "
          f"{scores['eval/mean_turns']:.1f} turns, {len(dialogues)} dialogue(s)")


def eval_key(seed: int) -> jax.Array:
  """Every held-out evaluation of a run samples from the same key: scores compare across steps."""
  return jax.random.key(seed + _EVAL_SEED_OFFSET)


def is_evaluation_step(spec: RunSpec, step: int) -> bool:
  every = spec.eval.every_steps
  return bool(every) and step > 0 and step % every == 0


def evaluation_missing(spec: RunSpec, step: int, writer: MetricsWriter) -> bool:
  """Whether the restored `step` is an evaluation step whose row has no evaluation (every host reads
  the same shared metrics.jsonl, so all agree)."""
  if not is_evaluation_step(spec, step):
    return False
  row = next((r for r in writer.history() if r.get("step") == step), None)
  return row is not None and "eval/score" not in row
