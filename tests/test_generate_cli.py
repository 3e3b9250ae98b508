"""`python -m rlver_jax.generate` on the embedded model: JSON output format, greedy determinism, and
the interactive chat that keeps its cache across turns."""
import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(args, stdin=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "rlver_jax.generate", *args], cwd=REPO, env=env,
                        input=stdin, capture_output=True, text=True, timeout=600)


def test_output_json_greedy(tmp_path):
  out = tmp_path / "out.json"
  proc = _run(["--chat", "--prompt=Say hello to Mia.", "--temperature=0", "--max_new_tokens=24",
               "--batch_size=2", f"--output_json={out}"])
  assert proc.returncode == 0, proc.stderr[-2000:]
  data = json.loads(out.read_text())
  assert set(data) == {"prompt_token_ids", "token_ids", "text", "logprobs"}
  assert len(data["token_ids"]) == 2 and data["token_ids"][0] == data["token_ids"][1]  # greedy
  ids, lps = data["token_ids"][0], data["logprobs"][0]
  assert 0 < len(ids) <= 24 and len(lps) == len(ids)
  assert all(lp <= 0.0 for lp in lps)
  from rlver_jax.models.embedded import embedded_model_dir
  from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
  chat = ChatTokens(load_tokenizer(embedded_model_dir()))
  # --chat renders with the template's own default system prompt.
  assert data["prompt_token_ids"][0] == chat.conversation(
      [{"role": "user", "content": "Say hello to Mia."}], add_generation_prompt=True)
  if len(ids) < 24:  # stopped: the stop token is the last id and is included
    assert ids[-1] in chat.stop_ids
  assert data["text"][0].strip() and data["text"][0].strip() in proc.stdout


def test_interactive_keeps_the_conversation(tmp_path):
  proc = _run(["--interactive", "--temperature=0", "--max_new_tokens=12"],
              stdin="My name is Ana.\nWhat did I just tell you?\n/exit\n")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.count("bot> ") == 2  # one reply per user turn, then /exit


def test_interactive_ends_cleanly_when_the_cache_is_full():
  # 96 slots hold the template's system prompt, a turn or two and nothing more.
  lines = "".join(f"Tell me something about the number {i}.\n" for i in range(8))
  proc = _run(["--interactive", "--temperature=0", "--max_new_tokens=16", "--max_len=96"], stdin=lines)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "[context full: 96 slots" in proc.stdout and proc.stdout.count("bot> ") >= 1


def test_bad_input_is_one_clear_line():
  for args, message in ((["--checkpoint=/nonexistent/model"], "--checkpoint=/nonexistent/model"),
                        (["--temperature=-1"], "temperature"),
                        (["--max_new_tokens=0"], "--max_new_tokens=0"),
                        (["--max_len=4"], "exceed the cache length 4")):
    proc = _run(["--chat", "--prompt=Hello there, how are you today?", *args])
    assert proc.returncode != 0
    last = [l for l in proc.stderr.strip().splitlines() if l.strip()][-1]
    assert last.startswith("error: ") and message in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
