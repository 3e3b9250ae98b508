"""What a run's results depend on beyond its config: the prompt texts (they live in code) and the
code version, the training profiles' contents, and the commit each Hub-id checkpoint resolved to.
Written to WORKDIR/provenance.json; a resume with different prompt texts or profiles is refused,
since mixing them in one run changes what the policy is trained on. A Hub branch that moved between
starts is only warned about: the config cannot be changed to pin it on resume.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import subprocess
from typing import Sequence

import jax
from absl import logging
from etils import epath

from rlver_jax.env import simulator_prompts as sim_prompts
from rlver_jax.env.chat import policy_system_prompt
from rlver_jax.env.profiles import Profile
from rlver_jax.models.io import hub
from rlver_jax.parallel.process_zero import on_process_zero
from rlver_jax.run.saved_config import ConfigConflictError

# A fixed stand-in persona: the fingerprint covers the templates, not any profile's content.
_PROBE = Profile(id="probe", player="<player>", scene="<scene>", main_cha="<main_cha>",
                 cha_group=("<cha_group>",), task="<task>")


def rendered_prompts(think: bool, style: str, training: str = "project") -> dict[str, str]:
  """Every prompt template of the policy (`training`: policy.prompt) and the simulator, rendered
  for both languages."""
  out = {}
  for lang in sim_prompts.LANGUAGES:
    out[f"policy_system/{lang}"] = policy_system_prompt(think, lang, training=training)
    out[f"simulator_system/{lang}"] = sim_prompts.system_prompt(_PROBE, style, lang)
    for passive in (False, True):
      out[f"opening/{lang}/{passive}"] = sim_prompts.opening_instruction(lang, passive)
      out[f"reply/{lang}/{passive}"] = sim_prompts.reply_instruction(50, "B", lang, passive)
    out[f"emotion/{lang}"] = sim_prompts.emotion_instruction("<policy reply>", 50, lang, style)
    out[f"retry/{lang}"] = sim_prompts.retry_instruction(lang)
    out[f"reply_retry/{lang}"] = sim_prompts.reply_retry_instruction(lang)
  return out


def prompts_sha256(think: bool, style: str, training: str = "project") -> str:
  blob = json.dumps(rendered_prompts(think, style, training), sort_keys=True, ensure_ascii=False)
  return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def git_commit() -> str:
  """HEAD of the checkout this package runs from ('+dirty' with uncommitted changes), or 'unknown'."""
  root = pathlib.Path(__file__).resolve().parents[2]
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, check=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")


def hub_checkpoints(spec) -> dict[str, dict[str, str]]:
  """Config key -> {"id", "commit"} of each checkpoint set to a Hub id. Resolving one downloads it
  if this process has not yet (with several processes, all call this at the same point); the
  loaders then reuse that snapshot."""
  return {key: {"id": setting, "commit": hub.commit_of(hub.resolve(setting, f"config.{key}"))}
          for key, setting in spec.checkpoints.items() if setting and hub.is_hub_id(setting)}


def describe(spec) -> dict:
  """This start's provenance; `spec` is the run's RunSpec or EvaluationSpec."""
  now = {"prompts_sha256": prompts_sha256(spec.policy.think, spec.simulator.style, spec.policy.prompt),
         "git_commit": git_commit(), "jax": jax.__version__}
  checkpoints = hub_checkpoints(spec)
  if checkpoints:
    now["hub_checkpoints"] = checkpoints
  return now


def profiles_sha256(profiles: Sequence[Profile]) -> str:
  """Fingerprint of the profiles' contents, in order (the sampler resumes by index into them)."""
  rows = [{k: v for k, v in dataclasses.asdict(p).items() if k != "source"} for p in profiles]
  blob = json.dumps(rows, sort_keys=True, ensure_ascii=False)
  return hashlib.sha256(blob.encode("utf-8")).hexdigest()


_WHAT = {"prompts_sha256": "the prompt texts", "profiles_sha256": "the training profiles' contents"}


def check(spec, workdir: str,
          profiles: Sequence[Profile] | None = None) -> dict:
  """This start's provenance; refuses a workdir whose run used other prompt texts or, given
  `profiles`, other profile contents (a file edited or replaced under the same path)."""
  path = epath.Path(workdir) / "provenance.json"
  now = describe(spec)
  if profiles is not None:
    now["profiles_sha256"] = profiles_sha256(profiles)
  if path.exists():
    history = json.loads(path.read_text())
    for key, what in _WHAT.items():
      # The first start that recorded it (runs begun before a key existed record it later).
      first = next((h[key] for h in history if key in h), None)
      if first is not None and key in now and first != now[key]:
        raise ConfigConflictError(
            f"{path}: {what} changed since this run started ({key} {first[:12]} -> "
            f"{now[key][:12]}); use a new --workdir")
    _warn_moved_branches(history, now.get("hub_checkpoints", {}))
  return now


def _warn_moved_branches(history: list[dict], checkpoints: dict[str, dict[str, str]]) -> None:
  for key, now in checkpoints.items():
    first = next((h["hub_checkpoints"][key] for h in history
                  if key in h.get("hub_checkpoints", {})), None)
    if first is not None and first["id"] == now["id"] and first["commit"] != now["commit"]:
      logging.warning("config.%s=%s is commit %s now, %s when this run started (the branch moved); "
                      "pin ORG/NAME@COMMIT in new runs to keep one", key, now["id"], now["commit"],
                      first["commit"])


def append(workdir: str, now: dict) -> None:
  """Adds this start to WORKDIR/provenance.json (a list: the first start, then each resume)."""
  path = epath.Path(workdir) / "provenance.json"

  def write() -> None:
    history = json.loads(path.read_text()) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(history + [now], indent=2) + "\n")
  on_process_zero(f"writing {path}", write)
