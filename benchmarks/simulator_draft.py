"""A draft for the simulator on real weights: acceptance and tokens/s, with and without it.

No same-tokenizer pair of real models installs from the package index (only SmolLM2-135M does), so
the draft here is the simulator's own first `--draft_layers` layers with its final norm and head (a
layer-skip draft: the same tokenizer by construction, real weights, weaker than a separately
trained small model of the family). Both runs play the same simulator turns of the demo profiles
(the opening, then each fixed policy reply: the analysis and the change and reply lines) at the
simulator's sampling settings, one row per profile, in one process: a warm-up round, then a timed
round. Reported per run: generated tokens, seconds, tokens/s, and with the draft
`simulator/draft_acceptance` (kept / proposed) and `simulator/tokens_per_verify`. At temperature 0
the two runs' answers must be identical (the exactness check on real weights).

  cd benchmarks && python simulator_draft.py                        # 10 of 30 layers, k = 4
  python simulator_draft.py --draft_layers=6 --draft_tokens=3 --temperature=0
  python simulator_draft.py --checkpoint=QWEN_72B_DIR --draft=QWEN_05B_DIR   # a real pair
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile
import time

import _common  # noqa: F401  (sets JAX_PLATFORMS=cpu before jax is imported)
import jax
from safetensors.numpy import load_file, save_file

from _common import command_line, machine_info, table
from rlver_jax import build
from rlver_jax.env.profiles import load_demo_profiles
from rlver_jax.env.simulator import SimulatedUsers
from rlver_jax.spec import SimulatorSpec

REPLIES = ["That sounds really hard. I'm here, tell me more about what happened.",
           "Honestly, you should just stop worrying so much.",
           "What part of this weighs on you the most?"]


def layer_skip_draft(source: str, layers: int, out: str) -> str:
  """An HF directory holding `source`'s first `layers` decoder layers, its embedding, final norm and
  head (every other file copied), so it loads as a model of `layers` layers."""
  src, dst = pathlib.Path(source), pathlib.Path(out)
  dst.mkdir(parents=True, exist_ok=True)
  config = json.loads((src / "config.json").read_text())
  if not 1 <= layers < config["num_hidden_layers"]:
    raise SystemExit(f"--draft_layers={layers}: must be in 1..{config['num_hidden_layers'] - 1}")
  config["num_hidden_layers"] = layers
  (dst / "config.json").write_text(json.dumps(config, indent=2))
  kept_name = lambda k: not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
  for f in src.iterdir():
    if f.suffix == ".safetensors":
      kept = {k: v for k, v in load_file(f).items() if kept_name(k)}
      save_file(kept, dst / f.name, metadata={"format": "pt"})
    elif f.name.endswith(".safetensors.index.json"):  # a sharded checkpoint's map, cut the same way
      index = json.loads(f.read_text())
      index["weight_map"] = {k: v for k, v in index["weight_map"].items() if kept_name(k)}
      (dst / f.name).write_text(json.dumps(index, indent=2))
    elif f.name != "config.json" and f.is_file():
      shutil.copy(f, dst / f.name)
  return str(dst)


def play(backend, profiles) -> list[str]:
  """The opening and one simulator turn per fixed reply, for every profile; the simulator's texts."""
  users = SimulatedUsers(profiles, backend, max_turns=len(REPLIES), max_parse_retries=0)
  users.opening()
  for reply in REPLIES:
    rows = users.live_rows()
    if rows:
      users.step(rows, [reply] * len(rows))
  return [str(rec) for rec in users.records]


def run(args, draft: str) -> dict:
  spec = SimulatorSpec(checkpoint=args.checkpoint, dtype=args.dtype, max_context=args.max_context,
                       max_new_tokens=args.max_new_tokens, max_parse_retries=0,
                       temperature=args.temperature, top_p=args.top_p if args.temperature else 1.0,
                       draft_checkpoint=draft, draft_tokens=args.draft_tokens)
  backend = build.simulator_backend(spec, None, seed=args.seed)
  profiles = load_demo_profiles()[:args.profiles]
  backend.reseed(jax.random.key(args.seed))
  play(backend, profiles)  # warm-up: every program compiled
  backend.take_draft_metrics()
  backend.reseed(jax.random.key(args.seed))
  before = backend.generated_tokens
  t0 = time.perf_counter()
  texts = play(backend, profiles)
  seconds = time.perf_counter() - t0
  tokens = backend.generated_tokens - before
  return dict(tokens=tokens, seconds=seconds, texts=texts, **backend.take_draft_metrics())


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", default="embedded")
  ap.add_argument("--draft", default="", help="a draft checkpoint; '' = a layer-skip draft")
  ap.add_argument("--draft_layers", type=int, default=10)
  ap.add_argument("--draft_tokens", type=int, default=4)
  ap.add_argument("--profiles", type=int, default=4)
  ap.add_argument("--max_new_tokens", type=int, default=128)
  ap.add_argument("--max_context", type=int, default=2048)
  ap.add_argument("--temperature", type=float, default=0.7)
  ap.add_argument("--top_p", type=float, default=0.9)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  print(command_line())
  print(machine_info())
  source = build.resolve_checkpoint(args.checkpoint, "--checkpoint")
  with tempfile.TemporaryDirectory() as tmp:
    draft = args.draft or layer_skip_draft(source, args.draft_layers, tmp + "/draft")
    plain, drafted = run(args, ""), run(args, draft)
  label = args.draft or f"first {args.draft_layers} layers"
  rows = []
  for name, r in (("no draft", plain), (f"{label}, k = {args.draft_tokens}", drafted)):
    rows.append([name, f"{r['tokens']:,}", f"{r['seconds']:.1f}", f"{r['tokens'] / r['seconds']:.1f}",
                 f"{r.get('simulator/draft_acceptance', float('nan')):.3f}",
                 f"{r.get('simulator/tokens_per_verify', 1.0):.2f}"])
  print(table(["simulator decode", "tokens", "s", "tokens/s", "draft_acceptance",
               "tokens_per_verify"], rows))
  print(f"tokens/s with / without the draft: "
        f"{drafted['tokens'] / drafted['seconds'] / (plain['tokens'] / plain['seconds']):.2f}")
  if args.temperature == 0:
    same = plain["texts"] == drafted["texts"]
    print(f"greedy answers identical with and without the draft: {same}")
    if not same:
      raise SystemExit("the draft changed a greedy answer")


if __name__ == "__main__":
  main()
