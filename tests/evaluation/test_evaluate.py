"""Sentient-style evaluation on the tiny world: the summary agrees with the transcripts, transcripts
have the documented shape, the plot is a PNG, and bad input changes nothing in the workdir."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import tiny_world
from rlver_jax import build
from rlver_jax.spec import EvaluationSpec
from rlver_jax.evaluation import sentient as eval_run

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import eval_sentient  # noqa: E402

_ADVICE = "You want advice that really helps you get out of your current difficulty."
_LISTEN = "You want the other person to listen attentively while you vent your emotions."
_PRAISE = "You want the other person to sincerely praise the specific things you did in the event."
# (id, task, main_cha, first_talk); in file order.
_PROFILES = (
    ("p0", _ADVICE, "negative", None),
    ("p1", _LISTEN, "passive", "hello we need to talk"),
    ("p2", _PRAISE, "avoidant", "so it is bad"),
    ("p3", _ADVICE, "passive", "what now"),
    ("p4", _LISTEN, "negative", None),
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  root = tmp_path_factory.mktemp("world")
  world = tiny_world.make_world(root)
  lines = []
  for pid, task, main_cha, first_talk in _PROFILES:
    p = {"id": pid, "player": "Sam, 30, a baker.", "scene": "Sam's week went badly.", "task": task,
         "main_cha": main_cha, "cha_group": ["anxious", "direct", "tired"]}
    if first_talk:
      p["first_talk"] = first_talk
    lines.append(json.dumps(p))
  world["profiles"] = str(root / "eval_profiles.jsonl")
  pathlib.Path(world["profiles"]).write_text("\n".join(lines) + "\n")
  return world


def _overrides(world, **extra) -> dict:
  out = {"policy.checkpoint": world["policy"], "simulator.backend": "scripted",
         "data.profiles": world["profiles"], "policy.think": False, "eval.policy_max_new_tokens": 6,
         "policy.max_context": 512, "policy.param_dtype": "float32", "policy.compute_dtype": "float32",
         "eval.batch_size": 2, "eval.max_turns": 3, "log.progress_bar": False}
  out.update(extra)
  return out


def _config(world, **extra):
  config = eval_sentient.get_config()
  tiny_world.apply(config, _overrides(world, **extra))
  return config


def _read(workdir):
  workdir = pathlib.Path(workdir)
  summary = json.loads((workdir / eval_run.SUMMARY_FILE).read_text())
  transcripts = [json.loads(l) for l in (workdir / eval_run.TRANSCRIPTS_FILE).read_text().splitlines()]
  return summary, transcripts


def test_config_defaults_and_runlocal():
  c = eval_sentient.get_config()
  assert (c.eval.start_emotion, c.eval.max_turns, c.eval.num_profiles) == (40, 9, 0)
  assert c.policy.think and c.simulator.style == "vanilla"
  with pytest.raises(AttributeError):
    c.eval.no_such_key = 1  # locked
  EvaluationSpec.from_config(c).rollout_config()  # every key has its spec field
  local = eval_sentient.get_config("runlocal,think=false,simulator=challenging")
  assert local.policy.checkpoint == local.simulator.checkpoint == "embedded"
  assert local.data.profiles == "demo" and not local.policy.think
  assert local.simulator.style == "challenging" and local.policy.compute_dtype == "float32"
  with pytest.raises(ValueError, match="unknown config argument"):
    eval_sentient.get_config("fast")


@pytest.mark.parametrize("start_emotion", [40, 2])
def test_summary_agrees_with_transcripts(world, tmp_path, start_emotion):
  config = _config(world, **{"eval.start_emotion": start_emotion})
  summary, paths = eval_run.run(EvaluationSpec.from_config(config), str(tmp_path))
  assert summary == _read(tmp_path)[0]
  summary, transcripts = _read(tmp_path)
  assert [t["profile_id"] for t in transcripts] == [p[0] for p in _PROFILES]
  finals = np.array([t["final_emotion"] for t in transcripts], np.float64)
  assert summary["num_dialogues"] == len(transcripts) == len(_PROFILES)
  assert summary["score"] == pytest.approx(finals.mean())
  assert summary["success_rate"] == pytest.approx((finals >= 100).mean())
  assert summary["failure_rate"] == pytest.approx((finals < 10).mean())
  replies = [sum(t["policy"] is not None for t in tr["turns"]) for tr in transcripts]
  assert summary["mean_turns"] == pytest.approx(np.mean(replies))
  assert summary["parse_failures"] == 0  # the scripted simulator always writes a change line
  assert summary["reply_failures"] == summary["silent_replies"] == 0  # ... and a reply line
  assert sum(summary["terminations"].values()) == len(transcripts)
  assert summary["terminations"] == {k: sum(t["termination"] == k for t in transcripts)
                                     for k in summary["terminations"]}
  assert set(summary["by_task"]) == {"actionable_advice", "listen_venting", "sincere_praise"}
  assert set(summary["by_main_cha"]) == {"negative", "passive", "avoidant"}
  assert sum(g["num_dialogues"] for g in summary["by_task"].values()) == len(transcripts)
  advice = [t["final_emotion"] for t in transcripts if t["task"] == _ADVICE]
  assert summary["by_task"]["actionable_advice"]["score"] == pytest.approx(np.mean(advice))
  assert summary["config"]["eval"]["start_emotion"] == start_emotion
  assert "simulator/draft_acceptance" not in summary  # no draft, no draft figures
  # The prompt texts and code version the score came from (prompts live in code, not the config).
  from rlver_jax.run import provenance
  assert summary["provenance"]["prompts_sha256"] == provenance.prompts_sha256(
      config.policy.think, config.simulator.style)
  assert summary["provenance"]["git_commit"]
  assert json.loads(pathlib.Path(paths["config"]).read_text()) == json.loads(config.to_json())
  for tr, (_, _, _, first_talk) in zip(transcripts, _PROFILES):
    _check_transcript(tr, first_talk, start_emotion, config.eval.max_turns)
  unreplied = [tr["turns"][-1]["policy"] is None for tr in transcripts]
  # From 40, three turns of at most -10 / +10 cannot end by emotion or goodbye; from 2 (state F: the
  # scripted user says goodbye) dialogues end early.
  assert not any(unreplied) if start_emotion == 40 else any(unreplied)
  png = pathlib.Path(paths["plot"]).read_bytes()
  assert png.startswith(b"\x89PNG\r\n\x1a\n")
  from PIL import Image
  with Image.open(paths["plot"]) as im:
    im.verify()


def test_a_simulator_draft_reports_its_acceptance(world, tmp_path):
  """The co-located simulator as its own draft (greedy, float32): every proposal is kept, and the
  summary says so beside the score."""
  config = _config(world, **{"simulator.backend": "model", "simulator.checkpoint": world["policy"],
                             "simulator.dtype": "float32", "simulator.temperature": 0.0,
                             "simulator.max_context": 512, "simulator.max_new_tokens": 8,
                             "simulator.max_parse_retries": 0,
                             "simulator.draft_checkpoint": world["policy"],
                             "simulator.draft_tokens": 3, "eval.num_profiles": 2,
                             "eval.max_turns": 1})
  summary, _ = eval_run.run(EvaluationSpec.from_config(config), str(tmp_path))
  assert summary["simulator/draft_acceptance"] == 1.0
  assert summary["simulator/tokens_per_verify"] > 2.0
  assert summary == _read(tmp_path)[0]


@pytest.fixture(scope="module")
def drafted(world, tmp_path_factory):
  """Two random models over the tiny world's tokenizer, wide enough apart that greedy replies vary:
  a policy, and a draft of another seed that proposes its tokens only now and then."""
  import jax.numpy as jnp
  from rlver_jax.models import create_model, export_pretrained
  from rlver_jax.models.io.hf import read_config
  root, cfg = tmp_path_factory.mktemp("drafted"), read_config(world["policy"])
  out = {}
  for name, seed in (("policy", 2), ("draft", 1)):
    out[name] = str(root / name)
    export_pretrained(create_model(cfg, dtype=jnp.float32, seed=seed, init_std=0.5), cfg,
                      out[name], tokenizer_dir=world["policy"], overwrite=True)
  return out


def test_a_policy_draft_keeps_the_greedy_replies(world, drafted, tmp_path):
  """The evaluated policy decoding with a draft (rollout.policy_draft_checkpoint), greedy: the same
  transcripts as without one, both with a draft that is mostly rejected and with the policy as its
  own draft (every proposal kept); the summary reports each draft's acceptance."""
  base = {"policy.checkpoint": drafted["policy"], "policy.temperature": 0.0, "policy.top_p": 1.0,
          "policy.top_k": 0, "eval.policy_max_new_tokens": 10, "eval.max_turns": 2}
  runs = {}
  for name, draft in (("none", ""), ("self", drafted["policy"]), ("other", drafted["draft"])):
    config = _config(world, **base, **{"rollout.policy_draft_checkpoint": draft,
                                       "rollout.policy_draft_tokens": 3})
    runs[name] = eval_run.run(EvaluationSpec.from_config(config), str(tmp_path / name))[0]
  replies = {n: [t["policy"] for tr in _read(tmp_path / n)[1] for t in tr["turns"]] for n in runs}
  assert len({w for r in replies["none"] if r for w in r.split()}) > 3   # varied replies
  assert replies["self"] == replies["none"] == replies["other"]
  assert "policy/draft_acceptance" not in runs["none"]
  assert runs["self"]["policy/draft_acceptance"] == 1.0
  assert runs["self"]["policy/tokens_per_verify"] > 2.0
  assert runs["other"]["policy/draft_acceptance"] < 0.5
  assert runs["self"]["score"] == runs["none"]["score"] == runs["other"]["score"]


def test_a_policy_draft_of_another_tokenizer_is_refused(world, tmp_path):
  config = _config(world, **{"rollout.policy_draft_checkpoint": "embedded"})
  with pytest.raises(build.ConfigError, match="rollout.policy_draft_checkpoint='embedded' has "
                     "another tokenizer .* a draft needs the policy's vocabulary"):
    eval_run.run(EvaluationSpec.from_config(config), str(tmp_path))
  assert not list(tmp_path.iterdir())


def _check_transcript(tr: dict, first_talk: str | None, start: int, max_turns: int) -> None:
  turns = tr["turns"]
  if first_talk:
    assert turns[0]["user"] == first_talk
  assert all(isinstance(t["user"], str) and t["user"] for t in turns)
  # Only the last user line may go unanswered (the dialogue ended on it), and then change is null.
  for i, t in enumerate(turns):
    replied = t["policy"] is not None
    assert replied or i == len(turns) - 1
    assert (t["change"] is None) == (not replied) == (t["simulator_reasoning"] is None)
  assert (turns[-1]["policy"] is None) == (tr["termination"] != "max_turns")
  replied = [t for t in turns if t["policy"] is not None]
  assert len(replied) <= max_turns
  emotion = start
  for t in replied:
    emotion = int(np.clip(emotion + t["change"], 0, 100))
    assert t["emotion"] == emotion
  assert tr["final_emotion"] == emotion == turns[-1]["emotion"]


def _existing_outputs(workdir: pathlib.Path) -> dict[str, str]:
  workdir.mkdir(parents=True, exist_ok=True)
  files = {eval_run.SUMMARY_FILE: '{"score": 1}\n', eval_run.CONFIG_FILE: '{"eval": {"batch_size": 1}}\n'}
  for name, text in files.items():
    (workdir / name).write_text(text)
  return files


@pytest.mark.parametrize("key,value,message", [
    ("data.profiles", "/nonexistent/p.jsonl", "config.data.profiles"),
    ("policy.checkpoint", "/nonexistent/model", "config.policy.checkpoint"),
    ("eval.num_profiles", 6, "config.eval.num_profiles"),
    ("eval.batch_size", 0, "config.eval.batch_size"),
    ("eval.start_emotion", 101, "config.eval.start_emotion"),
    ("simulator.style", "harsh", "config.simulator.style"),
    ("policy.language", "fr", "config.policy.language"),
    ("mesh.fsdp", 3, "config.mesh"),
])
def test_bad_input_leaves_workdir_alone(world, tmp_path, key, value, message):
  files = _existing_outputs(tmp_path)
  with pytest.raises(ValueError, match=message.replace(".", r"\.")):
    eval_run.run(EvaluationSpec.from_config(_config(world, **{key: value})), str(tmp_path))
  assert {n: (tmp_path / n).read_text() for n in files} == files
  assert sorted(os.listdir(tmp_path)) == sorted(files)


def test_training_dirs_are_refused(world, tmp_path):
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  (run / "config.json").write_text(json.dumps({"rl": {}, "policy": {}, "eval": {"num_profiles": 2}}))
  with pytest.raises(ValueError, match="rlver_jax.export"):  # a training run is not an HF checkpoint
    spec = EvaluationSpec.from_config(_config(world, **{"policy.checkpoint": str(run)}))
    eval_run.run(spec, str(tmp_path / "eval"))
  with pytest.raises(ValueError, match="another kind of run"):  # nor a place for eval outputs
    eval_run.run(EvaluationSpec.from_config(_config(world)), str(run))
  assert sorted(os.listdir(run)) == ["checkpoints", "config.json"]


def _cli(args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "rlver_jax.evaluate", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


def test_cli_runs_selected_profiles(world, tmp_path):
  flags = [f"--config={REPO}/configs/eval_sentient.py", f"--workdir={tmp_path}",
           "--config.eval.num_profiles=2"]
  flags += [f"--config.{k}={v}" for k, v in _overrides(world).items()]
  proc = _cli(flags)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "score" in proc.stdout
  summary, transcripts = _read(tmp_path)
  assert [t["profile_id"] for t in transcripts] == ["p0", "p1"]
  assert summary["num_dialogues"] == 2
  assert (tmp_path / eval_run.PLOT_FILE).exists() and (tmp_path / eval_run.CONFIG_FILE).exists()


@pytest.mark.parametrize("flag,message", [
    ("--config.data.profiles=/nonexistent/p.jsonl", "config.data.profiles"),
    ("--config.eval.no_such_key=1", "no_such_key"),
])
def test_cli_bad_input_is_one_clear_line(world, tmp_path, flag, message):
  files = _existing_outputs(tmp_path)
  flags = [f"--config={REPO}/configs/eval_sentient.py", f"--workdir={tmp_path}"]
  flags += [f"--config.{k}={v}" for k, v in _overrides(world).items()] + [flag]
  proc = _cli(flags)
  assert proc.returncode != 0
  last = [l for l in proc.stderr.strip().splitlines() if l.strip()][-1]
  assert last.startswith("error: ") and message in last, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert {n: (tmp_path / n).read_text() for n in files} == files
