"""A training step with a draft for the co-located simulator (simulator.draft_checkpoint): at
temperature 0 the simulator's tokens are those of the run without a draft, whether the draft is the
simulator itself (every proposal kept) or a random model (most rejected, in its own layout, under
continuous batching), in decode segments, and the step logs the draft's acceptance."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

import tiny_world
from rlver_jax import build
from rlver_jax.models import create_model, export_pretrained
from rlver_jax.models.presets import Qwen2Config
from rlver_jax.spec import ConfigError, RunSpec


@pytest.fixture(scope="module")
def world(tmp_path_factory):  # 4 q / 2 kv heads: the simulator decodes tensor parallel (2)
  root = tmp_path_factory.mktemp("world")
  out = tiny_world.make_world(root, num_heads=4, num_kv_heads=2)
  out["draft"] = _draft(root, "draft", extra_vocab=0)
  out["wide_draft"] = _draft(root, "wide_draft", extra_vocab=8)  # the same tokenizer, 8 more rows
  return out


def _draft(root, name: str, extra_vocab: int) -> str:
  """A random 1-kv-head model over the world's tokenizer ('auto' lays it out data-parallel)."""
  from rlver_jax.models.io.hf import read_config
  policy = read_config(str(root / "policy"))
  cfg = Qwen2Config(vocab_size=policy.vocab_size + extra_vocab, hidden_size=16,
                    intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                    tie_word_embeddings=True, eos_token_id=policy.eos_token_id, pad_token_id=0,
                    checkpoint_dtype="float32")
  model = create_model(cfg, dtype=jnp.float32, seed=7, init_std=0.3)
  out = root / name
  export_pretrained(model, cfg, str(out), tokenizer_dir=str(root / "policy" / "tok"), overwrite=True)
  return str(out)


def _config(world, **extra):
  # Greedy policy and simulator: the dialogues follow from the weights alone (rows=2 of 4 dialogues
  # lends rows as dialogues end, and gives the lockstep dialogues too). A 512-slot simulator cache
  # attends one window: one draft-and-verify program a run; answers of 10 tokens span 3 segments.
  return tiny_world.training_config(world, "grpo", **{
      "total_steps": 1, "simulator.backend": "model", "simulator.checkpoint": world["policy"],
      "simulator.dtype": "float32", "simulator.max_new_tokens": 10, "simulator.max_context": 512,
      "simulator.max_parse_retries": 0, "simulator.temperature": 0.0,
      "simulator.decode_segment": 4, "policy.temperature": 0.0, "rl.is_correction": "token_tis",
      "rl.profiles_per_step": 2, "rl.group_size": 2, **extra})


def _step(config, workdir):
  trainer = tiny_world.trainer(config, str(workdir))
  result = trainer.train_step()
  trainer.writer.write(trainer.step, result.metrics)
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return trainer, rows[-1], [d.transcript() for d in result.dialogues]


def test_greedy_transcripts_equal_the_run_without_a_draft(world, tmp_path):
  plain, plain_metrics, plain_text = _step(_config(world), tmp_path / "plain")
  assert "simulator/draft_acceptance" not in plain_metrics
  want = plain.backend.tokens
  assert sum(len(t) for t in want) > 0

  own, metrics, text = _step(_config(world, **{"simulator.draft_checkpoint": world["policy"],
                                               "simulator.draft_tokens": 3}), tmp_path / "own")
  assert own.backend.tokens == want and text == plain_text
  assert metrics["simulator/draft_acceptance"] == 1.0
  assert metrics["simulator/tokens_per_verify"] > 2.0
  assert metrics["calls/simulator/verify_calls"] > 0 and "calls/simulator/decode_calls" not in metrics

  rand, metrics, text = _step(_config(world, **{"simulator.draft_checkpoint": world["draft"],
                                                "rollout.rows": 2}), tmp_path / "random")
  assert rand.layouts["simulator_draft"] == "data=8 fsdp=1 tensor=1 (auto)"
  assert rand.backend.tokens == want and text == plain_text
  assert metrics["simulator/draft_acceptance"] < 0.5
  assert 1.0 <= metrics["simulator/tokens_per_verify"] < 2.0


def test_a_draft_needs_the_simulators_tokenizer_and_at_most_its_rows(world):
  def check(simulator, draft):
    spec = RunSpec.from_config(_config(world, **{"simulator.checkpoint": simulator,
                                                 "simulator.draft_checkpoint": draft}))
    return build.draft_config(spec.simulator)

  # The same tokenizer padded to more rows in the simulator (Qwen2.5-72B and its 0.5B draft).
  assert check(world["wide_draft"], world["policy"]).vocab_size == 37
  with pytest.raises(ConfigError, match=r"^config\.simulator\.draft_checkpoint='.*wide_draft' has "
                     r"45 vocabulary rows, config\.simulator\.checkpoint='.*policy' 37: a draft "
                     r"needs at most the simulator's$"):
    check(world["policy"], world["wide_draft"])
  with pytest.raises(ConfigError, match=r"^config\.simulator\.draft_checkpoint='embedded' has "
                     r"another tokenizer \(\d+ tokens\) than config\.simulator\.checkpoint="
                     r"'.*policy' \(37\): a draft needs the simulator's vocabulary$"):
    check(world["policy"], "embedded")
