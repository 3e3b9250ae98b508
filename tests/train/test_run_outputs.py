"""What a training run shows its user: held-out dialogues and emotion trajectories in TensorBoard,
a console without library INFO lines (unless --verbosity asks for them), warnings for a step that
teaches nothing, and an end-of-run summary."""
import json
import os
import pathlib
import re
import struct
import subprocess
import sys

import pytest

import tiny_world
from compile_flags import tiny_run_env
from rlver_jax.train import loop as train
from rlver_jax.spec import RunSpec
from rlver_jax.train.summary import reward_start_end, summary_lines

REPO = pathlib.Path(__file__).resolve().parents[2]
# absl's prefix (I1202 00:48:58.700942 140651256105856 file.py:35]) on a library's INFO line.
_LIBRARY_INFO = re.compile(r"^I\d{4} [\d:.]+ +\d+ (?!.*rlver_jax)\S+\.py:\d+\]", re.M)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


def _board(workdir: pathlib.Path) -> dict[str, dict[int, object]]:
  """tag -> step -> value (float, text or PNG bytes) from a run's TensorBoard event files."""
  from tensorboardX.proto import event_pb2
  out: dict[str, dict[int, object]] = {}
  for path in sorted((workdir / "tensorboard").glob("events.out.tfevents.*")):
    data, at = path.read_bytes(), 0
    while at < len(data):
      n, = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
      at += 12 + n + 4
      for v in event.summary.value:
        kind = v.WhichOneof("value")
        value = {"simple_value": lambda: v.simple_value,
                 "image": lambda: v.image.encoded_image_string,
                 "tensor": lambda: v.tensor.string_val[0].decode("utf-8")}[kind]()
        out.setdefault(v.tag, {})[event.step] = value
  return out


def _table(markdown: str) -> list[list[str]]:
  rows = [l for l in markdown.splitlines() if l.startswith("| ") and not l.startswith("| ---")]
  return [[c.strip() for c in r.strip("|").split(" | ")] for r in rows[1:]]  # header dropped


def test_held_out_dialogues_go_to_tensorboard_as_text_with_their_emotions(world, tmp_path):
  config = tiny_world.training_config(world, "grpo", total_steps=2, **{
      "eval.every_steps": 1, "data.num_holdout": 1, "eval.num_profiles": 1, "eval.max_turns": 2})
  train.run(RunSpec.from_config(config), str(tmp_path))
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  board = _board(tmp_path)
  texts = {t: v for t, v in board.items() if t.startswith("eval/dialogue/")}
  assert len(texts) == 1  # one held-out profile, one tag
  (tag, by_step), = texts.items()
  assert sorted(by_step) == [1, 2]
  for row in rows:
    text = by_step[row["step"]]
    assert tag.split("/")[2] in text.splitlines()[0]  # eval/dialogue/PROFILE/text_summary
    table = _table(text)
    replies = [r for r in table if r[3] != "-"]
    assert 1 <= len(replies) <= 2
    # Each row's emotion is the previous one moved by its change (from eval.start_emotion), and the
    # last one is the dialogue's final emotion: the held-out score of a single dialogue.
    emotion = config.eval.start_emotion
    for r in replies:
      emotion = max(0, min(100, emotion + int(r[3])))
      assert int(r[4]) == emotion
    assert emotion == row["eval/score"]
  images = board["eval/emotion_trajectories"]
  assert sorted(images) == [1, 2] and all(v.startswith(b"\x89PNG") for v in images.values())


def test_the_trainer_warns_about_a_step_without_signal(world, tmp_path, caplog):
  # Users who want deep empathy: its phrases have 2+ words, so a 1-token reply never earns a point
  # (a miss is -2, an empty reply -8), and from emotion 0 every reward is 0.
  from rlver_jax.env.profiles import HIDDEN_INTENTIONS_EN
  profiles = tmp_path / "empathy.jsonl"
  rows = [json.loads(l) for l in pathlib.Path(world["profiles"]).read_text().splitlines()]
  profiles.write_text("".join(json.dumps(dict(r, task=HIDDEN_INTENTIONS_EN[3])) + "\n" for r in rows))
  config = tiny_world.training_config(world, "grpo", total_steps=1, **{
      "policy.max_new_tokens": 1, "simulator.max_turns": 1, "simulator.start_emotion": 0,
      "data.profiles": str(profiles)})
  with caplog.at_level("WARNING"):
    train.run(RunSpec.from_config(config), str(tmp_path))
  row = json.loads((tmp_path / "metrics.jsonl").read_text())
  lines = [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]
  assert row["reward_std"] == 0  # the premise: no group has any reward variance
  assert lines and "step 1" in lines[0]
  assert row["unparsed_emotion_rate"] == 0.0  # the scripted user always writes a change line


def test_reward_start_end_never_overlaps():
  assert reward_start_end([0.1]) is None
  assert reward_start_end([0.1, 0.3]) == (0.1, 0.3, 1)
  first, last, n = reward_start_end([0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8])
  assert n == 3 and first == pytest.approx(0.2) and last == pytest.approx(0.7)


def _main(args, xla_cache: pathlib.Path):
  # The second launch loads what the first compiled: this test is about the console, not compiles.
  env = tiny_run_env(xla_cache)
  return _decoded(subprocess.run([sys.executable, "-m", "rlver_jax.main", *args], cwd=REPO, env=env,
                                 capture_output=True, timeout=900))


def _decoded(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
  """Its output as text, carriage returns kept (text=True would turn them into newlines)."""
  proc.stdout, proc.stderr = proc.stdout.decode(), proc.stderr.decode()
  return proc


def test_console_is_quiet_unless_asked_and_ends_with_a_summary(world, tmp_path):
  cache = tmp_path.parent / f"{tmp_path.name}_xla"
  flags = tiny_world.cli_flags(world, "grpo", str(tmp_path), 2, **{"log.transcripts_every": 1,
                                                                    "log.progress_bar": True})
  quiet = _main(flags, cache)
  assert quiet.returncode == 0, quiet.stderr[-3000:]
  assert not _LIBRARY_INFO.search(quiet.stderr), _LIBRARY_INFO.findall(quiet.stderr)[:3]
  # stderr is a pipe here, as a log file would be: a line per step, no bar frames.
  assert "\r" not in quiet.stderr
  assert [l.split(":")[0] for l in quiet.stderr.splitlines() if l.startswith("rlver step")] == [
      "rlver step 1/2", "rlver step 2/2"], quiet.stderr[-3000:]
  out = quiet.stdout
  assert "run finished at step 2" in out
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  first, last = rows[0]["reward_mean"], rows[1]["reward_mean"]
  assert (f"mean of the first 1 steps {first:.3f}, of the last 1 steps {last:.3f} "
          f"({last - first:+.3f}) over 2 steps") in out
  for path in ("reward.png", "transcripts", "tensorboard"):
    assert str(tmp_path / path) in out
  assert "a late dialogue (step 2" in out and "  policy: " in out
  # The same run continued one step with the absl flag: the libraries' INFO lines are back.
  loud = _main(tiny_world.cli_flags(world, "grpo", str(tmp_path), 3) + ["--verbosity=0"], cache)
  assert loud.returncode == 0, loud.stderr[-3000:]
  assert _LIBRARY_INFO.search(loud.stderr)


def test_summary_lines_without_transcripts(tmp_path):
  (tmp_path / "R.png").write_bytes(b"png")
  paths = {"reward_plot": str(tmp_path / "R.png"), "transcripts": str(tmp_path / "none"),
           "tensorboard": "TB"}
  lines = summary_lines([{"step": 1, "reward_mean": 0.25}], paths)
  assert lines == ["reward (final emotion / 100): 0.250 after 1 step(s)",
                   f"reward plot:  {tmp_path / 'R.png'}"]


def test_summary_lists_only_outputs_that_exist(tmp_path):
  # A resumed run that had nothing left to train, with transcripts and TensorBoard off: the
  # workdir holds metrics and checkpoints only (and the plot was not written).
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
  (tmp_path / "checkpoints" / "1").mkdir(parents=True)
  (tmp_path / "transcripts").mkdir()  # made, never written to
  paths = {"reward_plot": None, "transcripts": str(tmp_path / "transcripts"),
           "tensorboard": str(tmp_path / "tensorboard"), "metrics": str(tmp_path / "metrics.jsonl"),
           "checkpoints": str(tmp_path / "checkpoints")}
  lines = summary_lines([{"step": 1, "reward_mean": 0.5}], paths)
  assert lines == ["reward (final emotion / 100): 0.500 after 1 step(s)",
                   f"metrics:      {tmp_path / 'metrics.jsonl'}",
                   f"checkpoints:  {tmp_path / 'checkpoints'}"]
  (tmp_path / "checkpoints" / "1").rmdir()
  assert summary_lines([], paths) == [f"metrics:      {tmp_path / 'metrics.jsonl'}"]


# Two steps of a three-step run, as `python -m rlver_jax.main` runs them (absl's handler, Python's
# warnings), with a Python warning, an absl warning and a direct stderr line (as the preemption
# watcher writes) after the first.
_PROGRESS = """
import sys, warnings
from absl import app, logging
from rlver_jax.run.progress import Progress
from rlver_jax.train.loop import step_fields

def main(_):
  metrics = {"reward_mean": 0.25, "final_emotion_mean": 40.0, "turns_mean": 3.0,
             "rollout_seconds": 10.0, "update_seconds": 2.0}
  progress = Progress(3, 0, enabled=True)
  progress.update(1, step_fields(metrics))
  warnings.warn("python warning")
  logging.warning("absl warning")
  sys.stderr.write("preempted at step 1 of 3; run the same command to resume\\n")
  progress.update(1, step_fields(metrics))
  progress.close()
  assert sys.stderr is sys.__stderr__

app.run(main)
"""


def _run_progress(terminal: bool) -> str:
  """The stderr of `_PROGRESS`, sent to a pipe or to a pseudo-terminal."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  if not terminal:
    proc = _decoded(subprocess.run([sys.executable, "-c", _PROGRESS], env=env, capture_output=True,
                                   timeout=300))
    assert proc.returncode == 0, proc.stderr
    return proc.stderr
  import fcntl
  import pty
  import termios
  main, tty = pty.openpty()
  fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new one is 0 wide
  proc = subprocess.Popen([sys.executable, "-c", _PROGRESS], env=env, stderr=tty,
                          stdout=subprocess.DEVNULL)
  os.close(tty)
  out = b""
  while True:
    try:
      chunk = os.read(main, 4096)
    except OSError:  # EIO: the child closed the terminal
      break
    if not chunk:
      break
    out += chunk
  os.close(main)
  assert proc.wait(timeout=300) == 0, out.decode()
  return out.decode().replace("\r\n", "\n")  # the terminal's own newline translation


def _screen(text: str) -> list[str]:
  """The lines a terminal shows for `text`: a carriage return writes over the line from its start."""
  lines = []
  for line in text.split("\n"):
    shown = ""
    for part in line.split("\r"):
      shown = part + shown[len(part):]
    lines.append(shown.rstrip())
  return lines


def _messages(lines: list[str]) -> list[str]:
  return [l for l in lines if "python warning" in l or "absl warning" in l or "preempted" in l]


def test_progress_in_a_log_file_is_a_line_per_step_and_warnings_keep_their_lines():
  out = _run_progress(terminal=False)
  assert "\r" not in out, out  # no bar frames
  lines = out.splitlines()
  steps = [l for l in lines if l.startswith("rlver step")]
  assert steps == ["rlver step 1/3: reward=0.250 emotion=40.0 turns=3.0 step_s=12",
                   "rlver step 2/3: reward=0.250 emotion=40.0 turns=3.0 step_s=12"], out
  messages = _messages(lines)
  assert len(messages) == 3, out
  assert messages[0].endswith("UserWarning: python warning")
  assert messages[1].startswith("W") and messages[1].endswith("absl warning")
  assert messages[2] == "preempted at step 1 of 3; run the same command to resume"


def test_on_a_terminal_warnings_print_above_the_bar_on_lines_of_their_own():
  screen = _screen(_run_progress(terminal=True))
  messages = _messages(screen)
  assert len(messages) == 3, screen
  assert messages[0].endswith("UserWarning: python warning") and "rlver" not in messages[0]
  assert messages[1].startswith("W") and messages[1].endswith("absl warning")
  assert messages[2] == "preempted at step 1 of 3; run the same command to resume"
  bars = [l for l in screen if l.startswith("rlver:")]
  assert bars and bars[-1].startswith("rlver:  67%") and "2/3" in bars[-1], screen
  assert screen.index(messages[-1]) < screen.index(bars[-1])  # the bar is drawn again below them
