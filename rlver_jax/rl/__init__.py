"""Reinforcement learning on packed token batches: the update batch and its sizes (`batch`), packing
a rollout's samples into it (`pack`; several a row, read back per sample by `samples`), advantages
and returns for its rows (`prepare`, over the estimators in `advantages`; GRPO's per-turn
advantages in `turn_credit`), the token-level losses (`losses`) and the fused, donated update step
(`update`).

May import: models, parallel, jax/optax/flax. Not env (rollout samples are described by Protocols in
`pack`), not sampling, train, run or build: losses see arrays, not dialogues.
"""
