"""`python -m rlver_jax.generate` on the embedded model: JSON output format, greedy determinism, and
the interactive chat that keeps its cache across turns."""
import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


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


def _greedy(model_dir, ids, max_new_tokens):
  """In-process greedy reply from a fresh cache, as the CLI's sampler runs it (fp32, 2048 slots)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from rlver_jax.models import load_pretrained
  from rlver_jax.sampling.sampler import Sampler
  from rlver_jax.sampling.strategies import SamplingParams
  from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
  chat = ChatTokens(load_tokenizer(model_dir))
  model, _ = load_pretrained(model_dir, dtype=jnp.float32)
  sampler = Sampler(model, max_len=2048, stop_ids=chat.stop_ids, pad_id=chat.pad_id)
  params = nnx.state(model)
  cache, logits = sampler.prefill(params, sampler.init_cache(1), [ids])
  res = sampler.decode(params, cache, logits, rng=jax.random.key(0), max_new_tokens=max_new_tokens,
                       sampling=SamplingParams.make(0.0), reserve=1)
  return res.row(0)


def test_interactive_keeps_the_conversation():
  from rlver_jax.models.embedded import embedded_model_dir
  from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
  first, second = "My name is Ana.", "What is my name?"
  proc = _run(["--interactive", "--temperature=0", "--max_new_tokens=12"], stdin=f"{first}\n{second}\n/exit\n")
  assert proc.returncode == 0, proc.stderr[-2000:]
  replies = [line.split("bot> ", 1)[1] for line in proc.stdout.splitlines() if "bot> " in line]
  assert len(replies) == 2, proc.stdout  # one reply per user turn, then /exit
  model_dir = embedded_model_dir()
  chat = ChatTokens(load_tokenizer(model_dir))
  user = lambda text: {"role": "user", "content": text}
  reply1 = chat.decode(_greedy(model_dir, chat.conversation([user(first)], add_generation_prompt=True), 12))
  assert replies[0] == reply1.strip()
  # The second reply is the greedy continuation of the whole chat so far, not of the new turn alone.
  history = chat.conversation([user(first), {"role": "assistant", "content": reply1}, user(second)],
                              add_generation_prompt=True)
  assert replies[1] == chat.decode(_greedy(model_dir, history, 12)).strip()
  forgetful = chat.decode(_greedy(model_dir, chat.conversation([user(second)], add_generation_prompt=True), 12))
  assert forgetful.strip() != replies[1]  # so a version that drops the history fails here


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
                        (["--max_len=4"], "--max_len=4 leaves no room for a reply"),
                        (["--max_len=8193"], "--max_len=8193 exceeds the checkpoint's max_position_embeddings (8192)")):
    proc = _run(["--chat", "--prompt=Hello there, how are you today?", *args])
    assert proc.returncode != 0
    last = [l for l in proc.stderr.strip().splitlines() if l.strip()][-1]
    assert last.startswith("error: ") and message in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def _one_line_error(args, message):
  proc = _run(args)
  assert proc.returncode != 0, proc.stdout[-2000:]
  lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
  assert lines and lines[-1].startswith("error: ") and message in lines[-1], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_conflicting_and_empty_input_is_refused(tmp_path):
  from rlver_jax.models.embedded import embedded_model_dir
  from rlver_jax.models.tokenizer import ChatTokens, load_tokenizer
  prompt = "Hello there, how are you today?"
  n = len(ChatTokens(load_tokenizer(embedded_model_dir())).encode(prompt))
  for args, message in (
      (["--interactive", "--prompt=Hi"], "--prompt cannot be used with --interactive"),
      (["--interactive", f"--output_json={tmp_path / 'o.json'}"], "--output_json cannot be used with --interactive"),
      (["--interactive", "--batch_size=2"], "--batch_size cannot be used with --interactive"),
      (["--prompt=Hi", "--system=Be brief."], "--system needs --chat"),
      (["--prompt="], "--prompt encodes to no tokens"),
      (["--chat", "--prompt= "], "--prompt is empty"),  # the template alone would be accepted
      # Exactly full: no slot is left for the first reply token.
      ([f"--prompt={prompt}", f"--max_len={n}"], f"the prompt is {n} tokens and --max_len={n} leaves no room"),
  ):
    _one_line_error(args, message)
  assert not (tmp_path / "o.json").exists()


def test_bad_checkpoint_config_and_output_path(tmp_path):
  import shutil
  from rlver_jax.models.embedded import embedded_model_dir
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(os.path.join(embedded_model_dir(), name), ckpt / name)
  config = json.loads(pathlib.Path(embedded_model_dir(), "config.json").read_text())
  del config["num_hidden_layers"]
  (ckpt / "config.json").write_text(json.dumps(config))
  _one_line_error([f"--checkpoint={ckpt}", "--prompt=Hi"],
                  f"{ckpt}/config.json: required key 'num_hidden_layers' is missing")
  # Checked before the model loads: this checkpoint has no weights, yet the path is what is reported.
  bad = tmp_path / "no_such_dir" / "out.json"
  _one_line_error([f"--checkpoint={ckpt}", "--prompt=Hi", f"--output_json={bad}"],
                  f"--output_json={bad}: directory {bad.parent} does not exist")
