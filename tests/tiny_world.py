"""A tiny, fast RL world for trainer tests: a word-level ChatML tokenizer, a random 1-layer policy
checkpoint over it, and a profile file whose hidden intention the scripted simulator rewards with
single words ("try", "step", "plan"), so a policy can find and learn them within a few steps."""
from __future__ import annotations

import json
import pathlib

WORDS = ("try step plan hello the a is it you we they sure okay maybe really well so and but "
         "never always fine good bad yes no what how why when").split()
ROLES = ["system", "user", "assistant"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]


def make_tokenizer(out_dir: pathlib.Path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  vocab = {t: i for i, t in enumerate(SPECIAL + ROLES + WORDS)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.decoder = decoders.WordPiece()  # joins words with spaces
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
  fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
  fast.save_pretrained(out_dir)
  return fast


def make_world(root: pathlib.Path) -> dict[str, str]:
  """Writes root/policy (HF checkpoint + tokenizer) and root/profiles.jsonl; returns their paths."""
  import jax.numpy as jnp
  from rlver_jax.models import create_model, export_pretrained
  from rlver_jax.models.presets import Qwen2Config

  policy = root / "policy"
  tok = make_tokenizer(policy / "tok")
  cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True,
                    qkv_bias=True, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                    pad_token_id=0, checkpoint_dtype="float32")
  model = create_model(cfg, dtype=jnp.float32, seed=0, init_std=0.02)
  export_pretrained(model, cfg, str(policy), tokenizer_dir=str(policy / "tok"), overwrite=True)
  profile = {"id": "advice-1", "player": "Sam, 30, a baker who talks a lot.",
             "scene": "Sam's shop is failing and Sam does not know what to do next.",
             "main_cha": "negative", "cha_group": ["anxious", "direct", "tired"],
             "task": "You want advice that really helps you get out of your current difficulty."}
  profiles = root / "profiles.jsonl"
  profiles.write_text("\n".join(json.dumps(dict(profile, id=f"advice-{i}")) for i in range(4)) + "\n")
  return {"policy": str(policy), "profiles": str(profiles)}


def tiny_overrides(world: dict[str, str], algo: str) -> dict:
  """Config values (dotted keys) that run the trainer on the tiny world with the scripted simulator."""
  return {
      "policy.checkpoint": world["policy"], "simulator.backend": "scripted",
      "data.profiles": world["profiles"], "data.num_holdout": 0,
      "policy.think": False, "policy.max_new_tokens": 6, "policy.max_context": 512,
      "policy.compute_dtype": "float32", "policy.remat": "none",
      "simulator.max_turns": 2, "rl.profiles_per_step": 2 if algo == "grpo" else 8,
      "rl.group_size": 8 if algo == "grpo" else 1, "rl.micro_batch_size": 1,
      "rl.logits_chunk": 64, "optim.actor_lr": 3e-2, "optim.critic_lr": 3e-2,
      "optim.warmup_steps": 0, "optim.weight_decay": 0.0, "rl.entropy_coef": 0.0,
      "checkpoint.every_steps": 2, "eval.every_steps": 0, "log.transcripts_every": 0,
      "log.progress_bar": False,
  }


def training_config(world: dict[str, str], algo: str, **extra):
  """configs/base.py's no-think config for `algo` with the tiny-world overrides, then `extra` (dotted
  keys, e.g. **{"rl.kl_coef": 0.1})."""
  import importlib.util
  path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "base.py"
  spec = importlib.util.spec_from_file_location("tiny_world_base_config", path)
  base = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(base)
  config = base.get_base_config(algo, think=False, arg=None)
  apply(config, tiny_overrides(world, algo))
  apply(config, extra)
  return config


def apply(config, overrides: dict) -> None:
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value


def cli_flags(world: dict[str, str], algo: str, workdir: str, steps: int, **extra) -> list[str]:
  """`python -m rlver_jax.main` flags for a tiny-world run (`extra`: more dotted config overrides)."""
  repo = pathlib.Path(__file__).resolve().parents[1]
  out = [f"--config={repo}/configs/{algo}_nothink.py", f"--workdir={workdir}",
         f"--config.total_steps={steps}"]
  for k, v in {**tiny_overrides(world, algo), **extra}.items():
    out.append(f"--config.{k}={v}")
  return out
