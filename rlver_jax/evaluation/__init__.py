"""Evaluation: Sentient-style scoring against simulated users (`scoring`, `sentient`), and general
abilities through lm-evaluation-harness (`lm_eval_backend`, `general`, local `tasks/`).

May import: models, sampling, env, run, parallel, build, spec. Not: train, rl.
"""
