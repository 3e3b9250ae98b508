"""Ahead-of-time compilation for TPU topologies on a CPU machine: the programs of a training step
with their abstract inputs (`programs`; the update's batch is `rl.batch.UpdateBatch.abstract`), the
whole-run memory plan (`plan`), TPU slices and their HBM (`topology`), compiling and the memory
report (`report`), the typed settings it reads (`target`), each model's mesh (`layouts`: training,
policy decode, simulator decode over the same devices), and the command line (`cli`, run as `python -m rlver_jax.aot`). The step-time model
(`--estimate_time`): one call of each program at a chosen shape (`call_programs`), a step's calls
(`step_calls`), chips' peak FLOP/s, bandwidths and link latency (`chips`), collectives' bytes and
ring steps from the HLO (`collectives`), the roofline per call and per phase (`step_time`), the
decode floor (`floor`) and its flags (`step_time_cli`).

It reads a config file once, in `target`: a training config as the run's own `RunSpec` (so the
tool plans exactly the run the trainer would start), an aot config as `ForwardSpec`; every other
module takes those typed settings.

May import: models, sampling, rl, parallel, cli, build, spec.
Nothing imports it but its CLI and tests.
"""
