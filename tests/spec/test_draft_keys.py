"""The speculative simulator's keys: declared once, checked with one line naming the key."""
import pytest

from rlver_jax.spec import ConfigError, RunSpec, SimulatorSpec, default_tree


def test_off_by_default_and_read_from_a_config():
  sim = RunSpec.from_config(default_tree(RunSpec)).simulator
  assert (sim.draft_checkpoint, sim.draft_tokens, sim.draft_mesh) == ("", 4, "auto")
  tree = default_tree(RunSpec)
  tree["simulator"].update(draft_checkpoint="some/dir", draft_tokens=3, draft_mesh="8x1x1")
  spec = RunSpec.from_config(tree)
  assert spec.simulator.draft_tokens == 3
  assert spec.checkpoints["simulator.draft_checkpoint"] == "some/dir"


@pytest.mark.parametrize("values,message", [
    (dict(draft_tokens=0), r"^config\.simulator\.draft_tokens=0: must be an integer >= 1$"),
    (dict(draft_mesh="big"), r"^config\.simulator\.draft_mesh='big': expected 'auto'"),
    (dict(draft_checkpoint=1), r"^config\.simulator\.draft_checkpoint=1: must be a string"),
    (dict(draft_checkpoint="d", backend="scripted"),
     r"^config\.simulator\.draft_checkpoint='d': must be '' with simulator\.backend='scripted'"),
])
def test_bad_values_name_the_key(values, message):
  with pytest.raises(ConfigError, match=message):
    SimulatorSpec(**values)
