"""The trainer's calls/* metrics equal the program calls its samplers and updater really made
(counted by spies on the jitted programs themselves), for the policy and a co-located simulator."""
import collections

import pytest

import tiny_world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return tiny_world.make_world(tmp_path_factory.mktemp("world"))


def _spy(sampler, seen: collections.Counter) -> None:
  """Counts each append program call by (T, window) and each decode loop iteration by window."""
  append, decode = sampler._append, sampler._decode

  def spy_append(graphdef, params, cache, tokens, num_new, logits, *, window):
    seen[f"T{tokens.shape[1]}/W{window}"] += 1
    return append(graphdef, params, cache, tokens, num_new, logits, window=window)

  def spy_decode(*args, window, **kw):
    final = decode(*args, window=window, **kw)
    seen[f"decode_steps/W{window}"] += int(final.step)  # the while loop's own iteration count
    seen["decode_calls"] += 1
    return final

  sampler._append, sampler._decode = spy_append, spy_decode


def _recorded(metrics: dict, role: str) -> collections.Counter:
  """The metrics' calls of one role, append and prefill chunks merged (one program)."""
  out = collections.Counter()
  for key, n in metrics.items():
    prefix = f"calls/{role}/"
    if not key.startswith(prefix) or key.endswith("prefill_calls"):
      continue
    name = key[len(prefix):]
    for kind in ("append/", "prefill/"):
      name = name.removeprefix(kind)
    out[name] += int(n)
  return out


def test_logged_calls_equal_the_programs_run(world, tmp_path):
  config = tiny_world.training_config(world, "grpo", **{
      "total_steps": 1, "policy.think": True, "simulator.backend": "model", "rl.profiles_per_step": 1,
      "rl.group_size": 2,
      "simulator.checkpoint": world["policy"], "simulator.dtype": "float32",
      "simulator.max_context": 2048, "simulator.max_new_tokens": 8, "simulator.max_parse_retries": 0})
  trainer = tiny_world.trainer(config, str(tmp_path))
  seen = {"policy": collections.Counter(), "simulator": collections.Counter()}
  _spy(trainer.sampler, seen["policy"])
  _spy(trainer.backend.sampler, seen["simulator"])
  steps, update = trainer.policy_up._step, []

  def spy_step(params, opt_state, batch, scale):
    update.append(batch.tokens.shape)
    return steps(params, opt_state, batch, scale)

  trainer.policy_up._step = spy_step
  trainer.sampler.calls.append_chunk("append", 16, 999)  # e.g. a held-out evaluation's, before the step
  metrics = trainer.train_step().metrics
  assert "calls/policy/append/T16/W999" not in metrics
  for role in ("policy", "simulator"):
    assert sum(v for k, v in seen[role].items() if k.startswith("decode_steps/")) > 0
    assert _recorded(metrics, role) == seen[role], role
  assert metrics["calls/policy/prefill_calls"] == 1  # one prefill of the openings per rollout
  assert metrics["calls/update/micro_batches"] == sum(s[0] for s in update)
  assert {(metrics["calls/update/rows"], metrics["calls/update/length"])} == {s[1:] for s in update}
  assert metrics["calls/forward/micro_batches"] == update[0][0] * len(update)  # old log-probs only
