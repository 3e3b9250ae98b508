"""The trainer's state as one typed pytree: what an update changes, what a checkpoint holds, and
what is derived from them (the frozen reference, the rollout's decode copy).

Immutable: a step makes a new `TrainState` (`dataclasses.replace`), so nothing changes it in place
and a reader holding the last one (a save on SIGTERM) sees one whole step.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

# What a checkpoint holds, in the order earlier versions saved it (a plain dict, so their
# checkpoints restore into this one).
CHECKPOINTED = ("policy", "policy_opt", "critic", "critic_opt", "rng")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  policy: Any                 # nnx.State of the policy's parameters (the update's layout)
  policy_opt: Any             # its optax state
  rng: jax.Array              # the run's key data (uint32), replicated
  critic: Any = None          # PPO: the critic's parameters and optax state, else None
  critic_opt: Any = None
  reference: Any = None       # the frozen starting policy when a KL term needs it; not checkpointed
  rollout: Any = None         # the policy in the rollout's layout (`DecodeCopy`); derived, not saved

  def checkpointed(self) -> dict[str, Any]:
    """The part a checkpoint saves, as a dict keyed like `CHECKPOINTED` (absent critic: no keys)."""
    return {k: getattr(self, k) for k in CHECKPOINTED if getattr(self, k) is not None}

  def restored(self, saved: dict[str, Any]) -> "TrainState":
    """This state with a checkpoint's part in place; the rollout copy dropped (it is remade from
    the restored policy) and the reference kept (it is the starting policy, not trained)."""
    missing = set(self.checkpointed()) - set(saved)
    if missing:
      raise KeyError(f"the checkpoint lacks {sorted(missing)} of the train state")
    return dataclasses.replace(self, rollout=None, **{k: saved[k] for k in self.checkpointed()})
