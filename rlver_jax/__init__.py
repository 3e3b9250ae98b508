"""rlver_jax: RLVER (reinforcement learning with verifiable emotion rewards) in JAX, for TPU pods.

The top level holds the entry points (`main` trains, `evaluate`, `evaluate_general`, `generate`,
`export`; `python -m rlver_jax.aot` plans memory) and `build`, which turns the typed run spec
(`spec/`) into live parts. Below them, imports point one way:

  train/       the Trainer, its step, the loop with resume and preemption, held-out evaluation
  evaluation/  Sentient-style scoring and general abilities through lm-evaluation-harness
  aot/         ahead-of-time compilation for TPU topologies and the whole-run memory plan
  run/         a run's files: workdir, saved config, provenance, metrics, checkpoints
  spec/        the one reader of the ConfigDict: frozen dataclasses, each checking its keys
  env/         simulated users, their backends, and the batched dialogue rollout
  rl/          the update batch, advantages, losses and the fused update; GRPO/PPO as values
  sampling/    the KV cache and the prefill / append / decode programs
  models/      the Qwen2 family in Flax NNX and its checkpoint I/O (`io/`)
  parallel/    the device mesh, sharding rules and multi-host start-up
  cli/         flag parsing, errors and the quiet console shared by the entry points
"""
