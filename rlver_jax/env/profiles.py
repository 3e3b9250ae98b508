"""Simulated-user profiles (RLVER / SAGE JSONL format): loading, labels and sampling."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from typing import Any, Sequence

import numpy as np

_CJK = re.compile(r"[\u4e00-\u9fff]")


@dataclasses.dataclass(frozen=True)
class Profile:
  """One simulated user: persona, background story, personality type and hidden intention."""
  id: str
  player: str
  scene: str
  main_cha: str
  cha_group: tuple[str, ...]
  task: str
  first_talk: str | None = None
  # "PATH:LINE" it was read from, for errors; not part of its contents (equality, fingerprints).
  source: str = dataclasses.field(default="", compare=False, repr=False)

  @property
  def language(self) -> str:
    """"zh" when the persona is written in Chinese, else "en"."""
    return "zh" if _CJK.search(self.player + self.task) else "en"


# --- Labels -------------------------------------------------------------------------------------

INTENTION_KEYS: tuple[str, ...] = (
    "no_fault", "self_reflection", "critical_analysis", "deep_empathy",
    "listen_venting", "others_motives", "actionable_advice", "sincere_praise",
)

HIDDEN_INTENTIONS_EN: tuple[str, ...] = (
    "You believe you did nothing wrong in this and want the other person to agree that you are not"
    " to blame.",
    "You want the other person to guide you to reflect on the event yourself and grow from it.",
    "You want the other person to analyse the problems in the event critically, from both sides.",
    "You want the other person to truly empathise with your feelings, not just offer simple"
    " comfort.",
    "You want the other person to listen attentively while you vent your emotions.",
    "You want to understand why the other people in the event acted the way they did.",
    "You want advice that really helps you get out of your current difficulty.",
    "You want the other person to sincerely praise the specific things you did in the event.",
)

# Exactly as they appear in the training data's `task` field.
HIDDEN_INTENTIONS_ZH: tuple[str, ...] = (
    "你认为自己在事件中没有任何责任和错误，你想要对方也认同你没有错",
    "你希望对方引导你针对事件进行自我反思，收获自我成长",
    "你希望对方辩证地分析事件中的问题",
    "你希望对方深刻共情你的感受，而不是简单的安慰",
    "你希望对方用心倾听你的情绪宣泄",
    "你想分析事件中其他人物这么做的原因",
    "你想获得能真实帮助你解决当下困境的建议",
    "你希望对方真诚地夸奖你在事件中的具体行为",
)

TASK_TO_INTENTION: dict[str, str] = {
    **dict(zip(HIDDEN_INTENTIONS_EN, INTENTION_KEYS)),
    **dict(zip(HIDDEN_INTENTIONS_ZH, INTENTION_KEYS)),
}

PERSONALITY_KEYS: tuple[str, ...] = ("negative", "passive", "avoidant")
PERSONALITIES_ZH: tuple[str, ...] = ("负面型", "被动型", "回避型")

MAIN_CHA_TO_PERSONALITY: dict[str, str] = {
    **{k: k for k in PERSONALITY_KEYS},
    **dict(zip(PERSONALITIES_ZH, PERSONALITY_KEYS)),
}


def intention_key(profile: Profile | str) -> str:
  """Short key ("no_fault", ...) of a profile's hidden intention (or of a raw task string)."""
  task = profile if isinstance(profile, str) else profile.task
  try:
    return TASK_TO_INTENTION[task.strip()]
  except KeyError:
    raise ValueError(f"{_where(profile)}unknown hidden intention: {_short(task)}") from None


def personality_key(profile: Profile | str) -> str:
  """"negative" / "passive" / "avoidant" for a profile (or a raw main_cha string, zh or en)."""
  main_cha = profile if isinstance(profile, str) else profile.main_cha
  try:
    return MAIN_CHA_TO_PERSONALITY[main_cha.strip()]
  except KeyError:
    raise ValueError(f"{_where(profile)}unknown personality type: {_short(main_cha)}") from None


def _where(profile: Profile | str) -> str:
  return f"{profile.source}: " if isinstance(profile, Profile) and profile.source else ""


def _short(text: str, limit: int = 80) -> str:
  return repr(text if len(text) <= limit else text[:limit] + "...")


def check_scripted_labels(profiles: Sequence[Profile]) -> None:
  """The scripted simulator's rules know RLVER's 8 hidden intentions and 3 personality types: a
  profile with another is refused before the first step, naming its file and line."""
  for profile in profiles:
    try:
      intention_key(profile)
      personality_key(profile)
    except ValueError as e:
      raise ProfileError(f"{e} (the scripted simulator knows only RLVER's 8 hidden intentions and 3 "
                         "personality types, word for word as in its data)") from None


# --- Loading ------------------------------------------------------------------------------------

DEMO_PROFILES: str = str(pathlib.Path(__file__).resolve().parent / "data" / "demo_profiles.jsonl")
# The same 8 people, each only wanting to be heard (`listen_venting`): the scripted demo's users,
# whose rules (short, listening replies; no advice) a 135M policy can find at T=1 within minutes.
DEMO_VENTING_PROFILES: str = str(pathlib.Path(__file__).resolve().parent / "data" /
                                 "demo_venting_profiles.jsonl")
# Values of config.data.profiles that name a profile set shipped with the package.
DEMO_PROFILE_SETS: dict[str, str] = {"demo": DEMO_PROFILES, "demo_venting": DEMO_VENTING_PROFILES}

_REQUIRED_STR = ("id", "player", "scene", "main_cha", "task")
# The longest profile of RLVER's data is a few KB; one far longer cannot fit a simulator's prompt,
# and decoding and tokenizing it took minutes and gigabytes before anything said so.
MAX_LINE_BYTES = 1 << 20


class ProfileError(ValueError):
  """A profile file is malformed; the message is "{path}:{lineno}: {problem}"."""


class ProfileFileNotFound(ProfileError, FileNotFoundError):
  """The profile file does not exist (catchable both as ProfileError and FileNotFoundError)."""


def _gcs_client() -> Any:
  """A storage client; honours STORAGE_EMULATOR_HOST so tests can run against an emulator."""
  from google.cloud import storage  # Imported lazily: only gs:// paths need it.
  if os.environ.get("STORAGE_EMULATOR_HOST"):
    from google.auth.credentials import AnonymousCredentials
    return storage.Client(project="test", credentials=AnonymousCredentials())
  return storage.Client()


def _read_gcs(path: str) -> bytes:
  bucket, _, name = path[len("gs://"):].partition("/")
  if not bucket or not name:
    raise ProfileError(f"{path}: expected gs://bucket/object")
  from google.api_core import exceptions as gexc
  try:
    return _gcs_client().bucket(bucket).blob(name).download_as_bytes()
  except gexc.NotFound:
    raise ProfileFileNotFound(f"{path}: profile file not found") from None


def _read_bytes(path: str) -> bytes:
  if path.startswith("gs://"):
    return _read_gcs(path)
  try:
    return pathlib.Path(path).read_bytes()
  except FileNotFoundError:
    raise ProfileFileNotFound(f"{path}: profile file not found") from None
  except IsADirectoryError:
    raise ProfileError(f"{path}: is a directory, expected a JSONL file") from None


def _parse_line(obj: Any) -> Profile:
  """Builds a Profile from one decoded JSON value; raises ValueError naming the problem."""
  if not isinstance(obj, dict):
    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
  missing = [k for k in (*_REQUIRED_STR, "cha_group") if k not in obj]
  if missing:
    raise ValueError(f"missing required field(s): {', '.join(missing)}")
  for key in _REQUIRED_STR:
    value = obj[key]
    if not isinstance(value, str):
      raise ValueError(f"field {key!r} must be a string, got {type(value).__name__}")
    # An empty persona or intention would silently yield a meaningless dialogue.
    if not value.strip():
      raise ValueError(f"field {key!r} is empty")
  group = obj["cha_group"]
  if not isinstance(group, list) or not all(isinstance(t, str) for t in group):
    raise ValueError("field 'cha_group' must be a list of strings")
  first_talk = obj.get("first_talk")
  if first_talk is not None:
    if not isinstance(first_talk, str):
      raise ValueError(f"field 'first_talk' must be a string, got {type(first_talk).__name__}")
    if not first_talk.strip():
      raise ValueError("field 'first_talk' is empty (omit it or use null instead)")
  return Profile(id=obj["id"], player=obj["player"], scene=obj["scene"],
                 main_cha=obj["main_cha"], cha_group=tuple(group), task=obj["task"],
                 first_talk=first_talk)


def _json_problem(e: json.JSONDecodeError) -> str:
  """json's message with its column, as one phrase: its messages are written to be followed by
  ": line L column C", and some end in "at" ("Unterminated string starting at")."""
  msg = e.msg.removesuffix(" at")
  return f"{msg[:1].lower()}{msg[1:]} at column {e.colno}"


def load_profiles(path: str | os.PathLike[str]) -> list[Profile]:
  """Reads and validates a profile JSONL file from a local path or gs://bucket/object.

  Blank lines are skipped and unknown keys ignored; any other problem raises ProfileError.
  """
  path = os.fspath(path)
  raw = _read_bytes(path)
  profiles: list[Profile] = []
  first_seen: dict[str, int] = {}
  for lineno, line_bytes in enumerate(raw.split(b"\n"), start=1):
    if len(line_bytes) > MAX_LINE_BYTES:
      raise ProfileError(f"{path}:{lineno}: {len(line_bytes):,} bytes, over the limit of "
                         f"{MAX_LINE_BYTES:,} for one profile (a persona this long fits no "
                         "simulator's context)")
    try:
      line = line_bytes.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError:
      raise ProfileError(f"{path}:{lineno}: not valid UTF-8") from None
    if not line.strip():
      continue
    try:
      profile = dataclasses.replace(_parse_line(json.loads(line)), source=f"{path}:{lineno}")
    except json.JSONDecodeError as e:
      raise ProfileError(f"{path}:{lineno}: invalid JSON ({_json_problem(e)})") from None
    except ValueError as e:
      raise ProfileError(f"{path}:{lineno}: {e}") from None
    if profile.id in first_seen:
      raise ProfileError(
          f"{path}:{lineno}: duplicate id {profile.id!r} (first on line {first_seen[profile.id]})")
    first_seen[profile.id] = lineno
    profiles.append(profile)
  if not profiles:
    raise ProfileError(f"{path}: no profiles (file is empty)")
  return profiles


def load_demo_profiles() -> list[Profile]:
  """The 8 English demo profiles shipped with the package (one per hidden intention)."""
  return load_profiles(DEMO_PROFILES)


# --- Sampling -----------------------------------------------------------------------------------

# "epochs": every profile once per shuffled epoch; "with_replacement": each draw independent and
# uniform, as the reference samples (a profile may repeat within a step, another wait long).
PROFILE_SAMPLINGS = ("epochs", "with_replacement")
_DRAW_STREAM = 0x5A  # seeds of the with-replacement draws, apart from the epoch orders

def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
  # Seeding from (seed, epoch) makes every epoch's order independent of how we got there.
  return np.random.default_rng([seed, epoch]).permutation(n)


class ProfileSampler:
  """Deterministic, resumable stream of profiles: epoch-wise shuffled, or (`sampling`
  "with_replacement") uniform independent draws, the k-th seeded by (seed, k)."""

  def __init__(self, profiles: Sequence[Profile], seed: int = 0, sampling: str = "epochs"):
    if sampling not in PROFILE_SAMPLINGS:
      raise ValueError(f"unknown profile sampling {sampling!r}; expected one of {PROFILE_SAMPLINGS}")
    self._replace = sampling == "with_replacement"
    if not profiles:
      raise ValueError("ProfileSampler needs at least one profile")
    if seed < 0:
      raise ValueError(f"seed must be non-negative, got {seed}")
    self._profiles = tuple(profiles)
    self._seed = int(seed)
    self._epoch = 0
    self._position = 0
    self._order = _epoch_order(self._seed, 0, len(self._profiles))

  def __len__(self) -> int:
    return len(self._profiles)

  @property
  def epoch(self) -> int:
    return self._epoch

  @property
  def position(self) -> int:
    return self._position

  def next_batch(self, n: int) -> list[Profile]:
    """The next n profiles; a batch may span the end of one epoch and the start of the next."""
    if n < 0:
      raise ValueError(f"batch size must be non-negative, got {n}")
    batch: list[Profile] = []
    while self._replace and len(batch) < n:
      # The draw count is epoch x len + position, so the state format is the same in both modes.
      k = self._epoch * len(self._profiles) + self._position
      batch.append(self._profiles[np.random.default_rng([self._seed, _DRAW_STREAM, k])
                                  .integers(len(self._profiles))])
      self._position += 1
      if self._position == len(self._profiles):
        self._epoch, self._position = self._epoch + 1, 0
    while len(batch) < n:
      take = min(n - len(batch), len(self._profiles) - self._position)
      idx = self._order[self._position:self._position + take]
      batch.extend(self._profiles[i] for i in idx)
      self._position += take
      if self._position == len(self._profiles):
        self._start_epoch(self._epoch + 1)
    return batch

  def _start_epoch(self, epoch: int) -> None:
    self._epoch, self._position = epoch, 0
    self._order = _epoch_order(self._seed, epoch, len(self._profiles))

  def state_dict(self) -> dict[str, int]:
    """Plain-int state; num_profiles guards against resuming on a different data set."""
    return {"seed": self._seed, "epoch": self._epoch, "position": self._position,
            "num_profiles": len(self._profiles)}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    n = len(self._profiles)
    if "num_profiles" in state and int(state["num_profiles"]) != n:
      raise ValueError(
          f"sampler state is for {state['num_profiles']} profiles, this sampler has {n}")
    seed, epoch, position = int(state["seed"]), int(state["epoch"]), int(state["position"])
    if seed < 0 or epoch < 0 or not 0 <= position <= n:
      raise ValueError(f"invalid sampler state: {dict(state)}")
    self._seed = seed
    self._start_epoch(epoch)
    self._position = position
    if position == n:  # Normalise so the state always points at an unread profile.
      self._start_epoch(epoch + 1)


def repeat_for_groups(profiles: Sequence[Profile],
                      n: int) -> tuple[list[Profile], np.ndarray]:
  """Repeats each profile n times in a row for GRPO; group ids are 0..len(profiles)-1 (int32)."""
  if n < 1:
    raise ValueError(f"samples per group must be >= 1, got {n}")
  repeated = [p for p in profiles for _ in range(n)]
  group_ids = np.repeat(np.arange(len(profiles), dtype=np.int32), n)
  return repeated, group_ids


def split_holdout(profiles: Sequence[Profile], num_holdout: int,
                  seed: int) -> tuple[list[Profile], list[Profile]]:
  """Deterministic random split; both parts keep the original file order."""
  if not 0 <= num_holdout <= len(profiles):
    raise ValueError(f"num_holdout must be in [0, {len(profiles)}], got {num_holdout}")
  picked = set(np.random.default_rng(seed).permutation(len(profiles))[:num_holdout].tolist())
  train = [p for i, p in enumerate(profiles) if i not in picked]
  holdout = [p for i, p in enumerate(profiles) if i in picked]
  return train, holdout
