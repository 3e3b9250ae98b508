"""The simulator's draft model as the step-time model prices it (`sampling.speculative`).

A verify pass runs k + 1 positions through the simulator and keeps each row's longest valid prefix
plus one token. With each proposal kept independently with probability a (the i.i.d. model of
Leviathan et al. 2023), a pass yields (1 - a^(k+1)) / (1 - a) tokens on average and keeps
a (1 - a^k) / (1 - a) of its k proposals. A run logs the kept share, `simulator/draft_acceptance`
(kept / proposed), which `acceptance_from_ratio` turns back into a.

The draft's architecture comes from its checkpoint's config.json when `simulator.draft_checkpoint`
is a readable local directory (matched to a preset: the aot programs build presets), else from
`--draft_preset`.
"""
from __future__ import annotations

import dataclasses
import os

from rlver_jax.models.presets import PRESETS, Qwen2Config, from_hf_config
from rlver_jax.spec import RunSpec
from rlver_jax.spec.forward import ModelShape

# Per-token acceptance when none is measured: Qwen2.5-0.5B drafting Qwen2.5-1.5B / 7B at
# temperature 0.7 keeps 33-45% of 3 proposals (a = 0.54-0.65; sources in docs/PERFORMANCE.md).
# No figure for a 32B or 72B target was found; a larger gap to the draft should not raise it.
DEFAULT_ACCEPTANCE = 0.6


def tokens_per_pass(a: float, k: int) -> float:
  """Expected tokens a verify pass emits: the kept proposals and the one the target draws,
  (1 - a^(k+1)) / (1 - a) summed as 1 + a + ... + a^k (no cancellation near a = 1)."""
  return float(sum(a ** i for i in range(k + 1)))


def kept_share(a: float, k: int) -> float:
  """Expected kept / proposed draft tokens at per-token acceptance `a` (what a run logs)."""
  return (tokens_per_pass(a, k) - 1) / k


def acceptance_from_ratio(ratio: float, k: int) -> float:
  """The per-token acceptance a whose `kept_share` is `ratio` (bisection: it rises with a)."""
  if not 0 <= ratio <= 1:
    raise ValueError(f"draft acceptance {ratio}: must be in [0, 1]")
  lo, hi = 0.0, 1.0
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if kept_share(mid, k) < ratio else (lo, mid)
  return (lo + hi) / 2


@dataclasses.dataclass(frozen=True)
class Draft:
  """What pricing a draft needs: its model, k proposals a pass, acceptance a, and their sources."""
  model: ModelShape
  tokens: int
  acceptance: float
  source: str = ""

  def __post_init__(self):
    if not 0 <= self.acceptance <= 1:
      raise ValueError(f"--draft_acceptance={self.acceptance}: must be in [0, 1]")

  @property
  def per_pass(self) -> float:
    return tokens_per_pass(self.acceptance, self.tokens)


def match_preset(config: Qwen2Config) -> str:
  """The preset with `config`'s widths ("NAME:L" if its depth differs); ValueError if none."""
  widths = lambda c: (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_heads,
                      c.num_kv_heads, c.head_dim, c.tie_word_embeddings)
  for name, preset in PRESETS.items():
    if widths(preset) == widths(config):
      return name if preset.num_layers == config.num_layers else f"{name}:{config.num_layers}"
  raise ValueError(f"no preset has the widths {widths(config)} (vocabulary, hidden, MLP, heads, "
                   "kv heads, head dim, tied)")


def draft_shape(spec: RunSpec, preset: str | None) -> tuple[ModelShape, str] | None:
  """(the draft as the aot programs build it, where its architecture came from), or None when
  neither `simulator.draft_checkpoint` nor `preset` names one. Frozen like the simulator: its
  params and compute in `simulator.dtype`, a bf16 cache."""
  s = spec.simulator
  path = os.path.join(s.draft_checkpoint, "config.json") if s.draft_checkpoint else ""
  if path and os.path.isfile(path):
    name, source = match_preset(from_hf_config(path)), f"{path} (matched to a preset)"
  elif preset:
    name = preset
    source = f"--draft_preset={preset}" + (f" ({s.draft_checkpoint} not readable here)"
                                           if s.draft_checkpoint else "")
  elif s.draft_checkpoint:
    raise ValueError(f"simulator.draft_checkpoint={s.draft_checkpoint!r}: no config.json readable "
                     "here; name its architecture with --draft_preset (e.g. qwen2.5-0.5b)")
  else:
    return None
  model = ModelShape(preset=name, param_dtype=s.dtype, dtype=s.dtype, remat="none",
                     append_buckets=tuple(s.append_buckets))
  return model, source
