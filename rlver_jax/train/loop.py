"""The RLVER training loop: profiles -> rollout -> rewards -> advantages -> fused update -> metrics ->
checkpoint, with periodic evaluation on held-out profiles; resume from the newest good checkpoint,
and a SIGTERM or Ctrl-C saves the last finished step (exit status 75 or 130, `train.preemption`).

`run(config, workdir)` is the whole run behind `python -m rlver_jax.main`; the step itself is
`train.trainer.Trainer.train_step`, the held-out evaluation `train.holdout`. `Progress` shows the
steps: a bar on a terminal (warnings printed above it), a plain line per step in a log file.
"""
from __future__ import annotations

import contextlib
import signal

import jax
import numpy as np
from absl import logging

from rlver_jax.env.profiles import check_scripted_labels
from rlver_jax.env.rollout import RolloutInterrupted
from rlver_jax.env.simulator import SIMULATOR_ERROR
from rlver_jax.run.metrics import NotWritten
from rlver_jax.run.progress import Progress
from rlver_jax.spec import RunSpec
from rlver_jax.train.holdout import (eval_key, evaluate_holdout, evaluation_missing,
                                     is_evaluation_step, write_evaluation)
from rlver_jax.run.outcomes import outcome_of
from rlver_jax.train.preemption import PreemptionGuard, exit_stopped, save_and_exit
from rlver_jax.train.step_warnings import step_warnings
from rlver_jax.train.trainer import StepResult, TooManySimulatorErrors, Trainer, start_trainer


class TrainingDiverged(RuntimeError):
  pass


def check_finite_update(step: int, metrics: dict[str, float], last_saved: int | None) -> None:
  """Stops a run whose update produced a non-finite loss or gradient, before it saves the broken
  weights: with checkpoint.keep rotating, the good ones would soon be gone."""
  for k in ("loss", "grad_norm", "critic/loss", "critic/grad_norm"):
    if k in metrics and not np.isfinite(metrics[k]):
      saved = f"step {last_saved}" if last_saved is not None else "nothing yet"
      raise TrainingDiverged(f"step {step}: {k}={metrics[k]} after the update (training diverged); "
                             f"stopped without saving it, the last checkpoint holds {saved}")


def warn_about_step(spec: RunSpec, step: int, dialogues: list) -> list[str]:
  """Logs (and returns) the warnings for a step that teaches nothing (`step_warnings`)."""
  dialogues = [d for d in dialogues if d.termination != SIMULATOR_ERROR]  # not trained
  sim = spec.simulator
  alg = spec.algorithm
  # With turn credit a GRPO group can teach although its final rewards tie (different paths).
  credit = alg.grouped and alg.turn_credit != "none"
  lines = step_warnings(step, rewards=[d.reward for d in dialogues],
                        groups=alg.warning_groups([d.group_id for d in dialogues]),
                        parsed=[d.parsed for d in dialogues],
                        user_lines=sum(len(d.user_lines) for d in dialogues),
                        silent_replies=sum(d.silent_replies for d in dialogues),
                        backend=sim.backend, max_new_tokens=sim.max_new_tokens,
                        has_signal=bool(alg.informative_groups(dialogues)) if credit else None)
  for line in lines:
    logging.warning("%s", line)
  return lines


def step_fields(metrics: dict[str, float]) -> dict[str, str]:
  """What the progress display shows for a finished step."""
  return {"reward": f"{metrics['reward_mean']:.3f}",
          "emotion": f"{metrics['final_emotion_mean']:.1f}",
          "turns": f"{metrics['turns_mean']:.1f}",
          "step_s": f"{metrics['rollout_seconds'] + metrics['update_seconds']:.0f}"}


def _say(progress: Progress, line: str) -> None:
  """One line on process 0, above the progress bar (printed even when the bar is off)."""
  if jax.process_index() == 0:
    progress.write(line)


def run(spec: RunSpec, workdir: str, *, ctrl_c: bool = False) -> dict[str, str]:
  """Trains until spec.total_steps (resuming from WORKDIR/checkpoints) or a SIGTERM (or, with
  `ctrl_c`, a SIGINT); returns output paths, the step reached and `outcome` ("finished",
  "preempted" or "interrupted").

  `spec` is the run's typed spec (`RunSpec.from_config(config)` of a ConfigDict: building it checks
  every setting before anything loads)."""
  if not isinstance(spec, RunSpec):
    raise TypeError(f"train.loop.run takes a RunSpec (RunSpec.from_config(config)), not "
                    f"{type(spec).__name__}")
  total = spec.total_steps
  guard = PreemptionGuard(ctrl_c)  # entered before the models load: a signal then stops the run too
  started: list[Trainer] = []
  if jax.process_count() == 1:  # several hosts stop together at a polled point (the save is collective)
    guard.on_signal = lambda: (
        save_and_exit(started[0], total, spec.checkpoint.preempt_deadline_s, guard.signum)
        if started else
        exit_stopped(f"{_stopped(guard)} while starting, before step 1 of {total} could run; run the "
                     "same command to resume", guard.signum))
  with guard:
    trainer = start_trainer(spec, workdir)
    if spec.simulator.backend == "scripted":  # else the first rollout fails, naming no file
      check_scripted_labels([*trainer.train_profiles, *trainer.holdout])
    trainer.restore_if_any()
    started.append(trainer)
    return _train(trainer, guard)


def _train(trainer: Trainer, guard: PreemptionGuard) -> dict[str, str]:
  """The steps from the restored one to total_steps. A signal polled mid-rollout or mid-evaluation
  (RolloutInterrupted) and a step that lost too many simulator requests end the same way: the last
  finished step is saved (step 0, the pretrained start, needs none) and the run stops."""
  spec = trainer.spec
  progress = Progress(spec.total_steps, trainer.step,
                      enabled=spec.log.progress_bar and jax.process_index() == 0)
  stopped = False
  activity = ""  # what a signal interrupted, for its log line
  # finally: an error mid-run still completes the checkpoint saves already started (they are async).
  try:
    try:
      if evaluation_missing(spec, trainer.step, trainer.writer):
        # The step was saved, then its evaluation was cut short (a crash or SIGTERM): redo it.
        activity = f"the evaluation of step {trainer.step}"
        _evaluate(trainer, guard, progress)
      while trainer.step < spec.total_steps:
        activity = f"the rollout of step {trainer.step + 1}"
        # Polled between turns too: a rollout takes minutes and a preemption notice ~30 s.
        result = trainer.train_step(should_stop=guard.agreed)
        if _record_step(trainer, guard, result):
          logging.warning("%s: saved step %d, exiting", _signal_name(guard), trainer.step)
          stopped = True
          break
        if is_evaluation_step(spec, trainer.step):
          # Minutes long: a preemption notice (~30 s of grace) must not wait for its end.
          activity = f"the evaluation after step {trainer.step}"
          _evaluate(trainer, guard, progress)
        progress.update(1, step_fields(result.metrics))
    except (RolloutInterrupted, TooManySimulatorErrors) as e:
      with trainer.lock:
        if trainer.step > 0:  # the last finished step is kept (a no-op if it was just saved)
          trainer.save()
      if isinstance(e, TooManySimulatorErrors):  # the failed step is redone by the next run
        raise
      logging.warning("%s during %s: saved step %d, exiting", _signal_name(guard), activity,
                      trainer.step)
      stopped = True
  finally:
    progress.close()
    trainer.checkpointer.close()
  return _outputs(trainer, _stopped(guard) if stopped else "finished")


def _record_step(trainer: Trainer, guard: PreemptionGuard, result: StepResult) -> bool:
  """Writes the finished step's metrics (and transcripts), saves it when due or on a stop signal;
  returns whether a stop signal asks the run to stop."""
  step, every = trainer.step, trainer.spec.log.transcripts_every
  with trainer.lock, _saying_what_is_kept(trainer):
    trainer.writer.write(step, result.metrics)
    check_finite_update(step, result.metrics, trainer.checkpointer.latest_step())
    warn_about_step(trainer.spec, step, result.dialogues)
    if every and step % every == 0:
      trainer.writer.write_transcripts(step, [d.transcript() for d in result.dialogues])
    trainer.recorded_step = step
    preempted = guard.agreed()
    # Saved before the held-out evaluation: an evaluation that fails (e.g. its simulator server
    # is down) must not cost the step, and a preempted run has no time for one.
    if trainer.checkpointer.should_save(step, trainer.spec.total_steps) or preempted:
      trainer.save()
  return preempted


@contextlib.contextmanager
def _saying_what_is_kept(trainer: Trainer):
  """A run file that cannot be written (a full disk) stops the run with one line that also says
  which step the checkpoints still hold (the unwritten step is not saved)."""
  try:
    yield
  except NotWritten as e:
    saved = trainer.checkpointer.latest_step()
    kept = (f"the last checkpoint holds step {saved}" if saved is not None else
            "there is no checkpoint yet, so the run will start over from step 0")
    raise NotWritten(f"{e}; {kept}; free space and run the same command to resume") from e


def _evaluate(trainer: Trainer, guard: PreemptionGuard, progress: Progress) -> None:
  scores, dialogues = evaluate_holdout(trainer.spec, trainer.parts, trainer.rollout_params,
                                      trainer.holdout, eval_key(trainer.spec.seed), guard.agreed)
  with trainer.lock:
    _say(progress, write_evaluation(trainer.writer, trainer.step, scores, dialogues))


def _stopped(guard: PreemptionGuard) -> str:
  return outcome_of(guard.signum)


def _signal_name(guard: PreemptionGuard) -> str:
  return signal.Signals(guard.signum or signal.SIGTERM).name


def _outputs(trainer: Trainer, outcome: str) -> dict[str, str | None]:
  plot = trainer.writer.plot_rewards()
  trainer.writer.close()
  return {"metrics": str(trainer.writer.path), "checkpoints": str(trainer.checkpointer.directory),
          "transcripts": str(trainer.writer.transcripts),
          "reward_plot": None if plot is None else str(plot),
          "tensorboard": f"{trainer.workdir}/tensorboard", "step": str(trainer.step),
          "outcome": outcome}
