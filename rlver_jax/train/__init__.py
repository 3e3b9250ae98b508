"""Training: the Trainer and one step (`trainer`: rollout, batch, update, step metrics; GRPO's
dynamic sampling over extra rollout rounds in `dynamic_sampling`), the held-out evaluation between
steps (`holdout`), the loop with resume and preemption (`loop`, `preemption`), the per-step warnings
(`step_warnings`), the step's program calls as metrics (`call_metrics`) and the end-of-run summary
(`summary`). Settings come as the typed run spec (`rlver_jax.spec`), checked before anything loads.

May import every lower folder (models, sampling, env, rl, run, parallel, evaluation), build and spec.
"""
