"""A run's files and their rules: the workdir (`workdir`), the saved config checked on resume
(`saved_config`), provenance (`provenance`: prompt texts, code version, profiles), metrics and
TensorBoard (`metrics`) and optional W&B (`wandb_writer`), orbax checkpoints with damaged-step fallback (`checkpoint`) and their per-array checksums
(`checkpoint_integrity`), the trained
policy read back from a workdir (`trained_policy`), the persistent compilation cache
(`compile_cache`), a training start's checks and records (`start`) and how a stopped run ends
(`outcomes`).

May import: models, parallel, spec, env (provenance hashes the prompt texts and profiles), and build
(only `trained_policy`, which rebuilds the run's policy). Not: rl, train, evaluation, aot.
"""
