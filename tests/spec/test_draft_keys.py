"""The speculative simulator's and evaluated policy's keys: declared once, checked with one line
naming the key."""
import pytest

from rlver_jax.spec import ConfigError, EvaluationSpec, RunSpec, SimulatorSpec, default_tree
from rlver_jax.spec.sections import EvalRolloutSpec


def test_off_by_default_and_read_from_a_config():
  sim = RunSpec.from_config(default_tree(RunSpec)).simulator
  assert (sim.draft_checkpoint, sim.draft_tokens, sim.draft_mesh) == ("", 4, "auto")
  tree = default_tree(RunSpec)
  tree["simulator"].update(draft_checkpoint="some/dir", draft_tokens=3, draft_mesh="8x1x1")
  spec = RunSpec.from_config(tree)
  assert spec.simulator.draft_tokens == 3
  assert spec.checkpoints["simulator.draft_checkpoint"] == "some/dir"


def test_the_evaluated_policys_draft_is_off_by_default_and_an_input():
  tree = default_tree(EvaluationSpec)
  r = EvaluationSpec.from_config(tree).rollout
  assert (r.policy_draft_checkpoint, r.policy_draft_tokens, r.policy_draft_mesh) == ("", 4, "auto")
  tree["rollout"].update(policy_draft_checkpoint="small/dir", policy_draft_tokens=2)
  spec = EvaluationSpec.from_config(tree)
  assert spec.rollout.policy_draft_tokens == 2
  assert spec.checkpoints["rollout.policy_draft_checkpoint"] == "small/dir"


@pytest.mark.parametrize("section,values,message", [
    (SimulatorSpec, dict(draft_tokens=0),
     r"^config\.simulator\.draft_tokens=0: must be an integer >= 1$"),
    (SimulatorSpec, dict(draft_mesh="big"), r"^config\.simulator\.draft_mesh='big': expected 'auto'"),
    (SimulatorSpec, dict(draft_checkpoint=1),
     r"^config\.simulator\.draft_checkpoint=1: must be a string"),
    (SimulatorSpec, dict(draft_checkpoint="d", backend="scripted"),
     r"^config\.simulator\.draft_checkpoint='d': must be '' with simulator\.backend='scripted'"),
    (EvalRolloutSpec, dict(policy_draft_tokens=0),
     r"^config\.rollout\.policy_draft_tokens=0: must be an integer >= 1$"),
    (EvalRolloutSpec, dict(policy_draft_mesh="big"),
     r"^config\.rollout\.policy_draft_mesh='big': expected 'auto'"),
    (EvalRolloutSpec, dict(policy_draft_checkpoint=None),
     r"^config\.rollout\.policy_draft_checkpoint=None: must be a string"),
])
def test_bad_values_name_the_key(section, values, message):
  with pytest.raises(ConfigError, match=message):
    section(**values)
