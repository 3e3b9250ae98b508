"""The environment: simulated users and the batched dialogues the policy plays against them.

- `profiles`: user profiles (persona, hidden intention), loading and per-step sampling.
- `simulator`: `SimulatedUsers`, the per-dialogue emotion state machine driven turn by turn; it is
  the only writer of each dialogue's `user_state.UserState` (emotion, changes, replies, ending,
  reward), which everything else reads. `simulator_prompts` holds its texts, `parsing` reads its
  answers (the stated change, the reply line, the analysis sections), `info_flow` says what its
  steps see of each other (one growing chat, or the reference's clean transcript). `user_rules`:
  the checked rules a batch plays by (style, start emotion, turns, end, change rules), built from the
  config by `SimulatorSpec.user_rules` for training and both evaluations.
- `backends`: the `SimulatorBackend` protocol and the scripted and OpenAI-compatible HTTP backends
  (`scripted_rules` are the scripted one's rules); `model_backend`: a co-located model, whose
  `expected_change` gives the mean change under its own distribution (`simulator.change_mode`).
- `chat`: the policy's system prompts and the parsing of its output (think format, goodbyes).
- `rollout`: `run_dialogues`, policy and user turns in lockstep (or on at most `rows` cache rows),
  giving `Dialogue`s with their training samples and rewards; `scheduler`: continuous batching
  (rows lent to dialogues, whole groups admitted in order, per-dialogue key streams).

May import: models (tokenizer), sampling, parallel. Not: rl, train, run, evaluation, aot, cli.
"""
