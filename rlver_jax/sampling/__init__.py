"""KV-cached generation on device: the preallocated cache and the view a cached forward pass reads it
through (`kv_cache`: `KVCache`, `CacheView`), token selection with traced settings (`strategies`:
`SamplingParams`, `sample`), and the prefill / append / decode programs with their typed loop state
and result (`sampler`: `Sampler`, `DecodeState`, `DecodeResult`), the traced stop rules the decode
loop checks (`stop_rules`: `StopRules`, token sequences and the end of a labelled line), the count of
each program's calls (`call_counts`: `CallCounts`, read by the step-time model), and the log-probs of
alternative continuations of each row's cached prefix in one read-only pass (`branches`:
`score_branches`), a trained model's weights as decode reads them, cast and resharded into its
rollout layout after each update (`decode_copy`: `DecodeCopy`), and draft-and-verify decode for a
frozen model, exact in distribution (`speculative`: `SpeculativeSampler`; the rule in `draft_rule`).

May import: models, parallel. Not: env, rl, train, run, evaluation (those call into it).
"""
