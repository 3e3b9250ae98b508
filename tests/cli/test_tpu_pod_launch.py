"""Tests for launch/tpu_pod.sh, the Cloud TPU VM launcher.

No real gcloud is ever run: a fake `gcloud` placed first on PATH records its
argv.  Under --dry-run the fake fails loudly if it is called at all.  For the
non-dry-run tests it plays a one-worker TPU VM whose home is a temporary
directory: `ssh --command=...` runs the command there through /bin/sh (as sshd
would, through the login shell) and `scp` copies into that home.
"""
import json
import os
import pathlib
import shlex
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "tpu_pod.sh"
USAGE = ("usage: launch/tpu_pod.sh [--dry-run] {create,install,run,logs,stop,delete} --name=NAME "
         "--zone=ZONE --accelerator=TYPE [--project=P] [--spot] [-- COMMAND ...]")
AWKWARD = ["--config.note=two words", "it's", 'say "hi"', "$HOME", "a;b", "back\\slash", "*", "", "$(touch pwned)"]

_FAKE_GCLOUD = f"""#!{sys.executable}
import json, os, shutil, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
  f.write(json.dumps(args) + "\\n")
if os.environ.get("FAKE_GCLOUD_FORBID"):
  sys.stderr.write("fake gcloud: called although --dry-run was given\\n")
  sys.exit(97)
verb = args[3] if len(args) > 3 else ""
home = os.environ.get("FAKE_REMOTE_HOME", "")
if verb == "describe":
  if "FAKE_DESCRIBE" not in os.environ:
    sys.stderr.write("ERROR: NOT_FOUND\\n")
    sys.exit(1)
  print(os.environ["FAKE_DESCRIBE"])
elif verb == "scp":
  shutil.copy(args[4], os.path.join(home, args[5].split(":", 1)[1]))
elif verb == "ssh":
  command = [a for a in args if a.startswith("--command=")][0][len("--command="):]
  env = dict(os.environ, HOME=home)
  sys.exit(subprocess.run(["/bin/sh", "-c", command], env=env, cwd=home).returncode)
"""


def _write_exe(path: pathlib.Path, text: str) -> None:
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def fake(tmp_path):
  """A fake gcloud first on PATH; returns a helper namespace."""
  bin_dir = tmp_path / "fakebin"
  bin_dir.mkdir()
  _write_exe(bin_dir / "gcloud", _FAKE_GCLOUD)
  home = tmp_path / "worker_home"
  home.mkdir()
  log = tmp_path / "gcloud_calls.jsonl"
  log.touch()
  env = dict(os.environ)
  env.update(
      PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
      FAKE_GCLOUD_LOG=str(log),
      FAKE_REMOTE_HOME=str(home),
      TMPDIR=str(tmp_path),
      GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
      GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com",
      GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
  )
  env.pop("FAKE_DESCRIBE", None)

  class Fake:
    pass

  f = Fake()
  f.bin, f.home, f.env, f.tmp = bin_dir, home, env, tmp_path

  def calls():
    return [json.loads(l) for l in log.read_text().splitlines()]

  def run(*args, dry_run=False, script=SCRIPT, extra_env=None, timeout=60):
    e = dict(env)
    if dry_run:
      e["FAKE_GCLOUD_FORBID"] = "1"
    e.update(extra_env or {})
    cmd = [str(script)] + (["--dry-run"] if dry_run else []) + list(args)
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout, check=False)

  f.calls, f.run = calls, run
  yield f
  # Never leave a job behind: SIGKILL the process group recorded by `run`.
  pid_file = home / "rlver_jax" / "run.pid"
  if pid_file.exists() and pid_file.read_text().strip():
    _killpg_quietly(int(pid_file.read_text()), signal.SIGKILL)


def _killpg_quietly(pgid: int, sig: int) -> None:
  try:
    os.killpg(pgid, sig)
  except (ProcessLookupError, PermissionError):
    pass


POD = ["--name=my-pod", "--zone=us-east5-a", "--accelerator=v5p-32", "--project=my-proj"]


def dry(fake, *args, **kw):
  """Runs with --dry-run; returns the printed commands (one a line) as argv lists."""
  r = fake.run(*args, dry_run=True, **kw)
  assert r.returncode == 0, r.stderr
  assert fake.calls() == [], "gcloud was invoked during --dry-run"
  lines = r.stdout.splitlines()
  assert lines and all(l.startswith("+ ") for l in lines), r.stdout
  return [shlex.split(l[2:]) for l in lines]


def remote(argv):
  """(script, args) of a `gcloud ... ssh --command='bash -c SCRIPT NAME ARG...'`."""
  [command] = [a[len("--command="):] for a in argv if a.startswith("--command=")]
  words = shlex.split(command)
  assert words[:2] == ["bash", "-c"] and len(words) >= 4, words
  assert "\n" not in words[2]
  return words[2], words[4:]


# ------------------------------------------------------------------ dry runs
def test_create_dry_run(fake):
  describe, create = dry(fake, "create", *POD, "--spot")
  assert describe[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "my-pod"]
  assert "--zone=us-east5-a" in describe and "--project=my-proj" in describe
  assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "my-pod"]
  for flag in ["--zone=us-east5-a", "--project=my-proj", "--accelerator-type=v5p-32",
               "--version=v2-alpha-tpuv5", "--spot"]:
    assert flag in create


def test_create_without_spot_or_project(fake):
  _, create = dry(fake, "create", "--name=n", "--zone=z", "--accelerator=v4-8")
  assert "--spot" not in create
  assert not any(a.startswith("--project") for a in create)
  assert "--version=tpu-ubuntu2204-base" in create


@pytest.mark.parametrize("accel,runtime", [
    ("v5p-8", "v2-alpha-tpuv5"),
    ("v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v5e-4", "v2-alpha-tpuv5-lite"),
    ("v6e-8", "v2-alpha-tpuv6e"),
    ("v4-32", "tpu-ubuntu2204-base"),
])
def test_default_runtime(fake, accel, runtime):
  _, create = dry(fake, "create", "--name=n", "--zone=z", f"--accelerator={accel}")
  assert f"--accelerator-type={accel}" in create
  assert f"--version={runtime}" in create


def test_runtime_override_and_space_separated_values(fake):
  _, create = dry(fake, "create", "--name", "n", "--zone", "z", "--accelerator", "v9x-8",
                  "--runtime=my-image")
  assert "--version=my-image" in create and "--accelerator-type=v9x-8" in create


def test_install_dry_run(fake):
  [ssh] = dry(fake, "install", *POD, "--repo=https://example.com/r.git", "--ref=v1.2")
  assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-pod"]
  for flag in ["--zone=us-east5-a", "--project=my-proj", "--worker=all"]:
    assert flag in ssh
  script, args = remote(ssh)
  assert args == ["https://example.com/r.git", "v1.2", ""]
  assert 'pip install --quiet -e ".[tpu]"' in script


def test_install_defaults_to_origin_remote(fake, tmp_path):
  checkout = tmp_path / "checkout"
  (checkout / "launch").mkdir(parents=True)
  script = checkout / "launch" / "tpu_pod.sh"
  script.write_bytes(SCRIPT.read_bytes())
  script.chmod(0o755)
  subprocess.run(["git", "init", "-q", str(checkout)], check=True, env=fake.env)
  r = fake.run("install", "--name=n", "--zone=z", dry_run=True, script=script)
  assert r.returncode == 2 and USAGE in r.stderr and "--repo" in r.stderr
  subprocess.run(["git", "-C", str(checkout), "remote", "add", "origin", "https://example.com/o.git"],
                 check=True, env=fake.env)
  [ssh] = dry(fake, "install", "--name=n", "--zone=z", script=script)
  assert remote(ssh)[1] == ["https://example.com/o.git", "main", ""]


def test_install_local_repo_dry_run(fake, tmp_path):
  repo = _make_repo(tmp_path / "src", fake.env)
  bundle, scp, ssh = dry(fake, "install", *POD, f"--repo={repo}")
  assert bundle[:5] == ["git", "-C", str(repo), "bundle", "create"]
  assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
  assert scp[5] == bundle[5] and scp[6] == "my-pod:rlver_jax.bundle" and "--worker=all" in scp
  assert remote(ssh)[1] == ["~/rlver_jax.bundle", "main", ""]
  assert not list(tmp_path.glob("rlver_jax_bundle.*")), "dry run created a bundle"


def test_run_dry_run_quotes_awkward_arguments(fake):
  command = ["python", "-m", "rlver_jax.main", *AWKWARD]
  [ssh] = dry(fake, "run", *POD, "--", *command)
  assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-pod"]
  for flag in ["--zone=us-east5-a", "--project=my-proj", "--worker=all"]:
    assert flag in ssh
  script, args = remote(ssh)
  assert args == ["~/rlver_jax/run.log", *command]
  assert "nohup" in script and "run.pid" in script and ".venv/bin/activate" in script
  # The job runs under the loop that restarts it on the trainer's "preempted" status (75).
  assert 'bash -c "$retry_loop" rlver_retry "$@"' in script and '"$rc" -ne 75' in script


def test_run_dashes_after_separator_belong_to_command(fake):
  [ssh] = dry(fake, "run", "--name=n", "--zone=z", "--", "prog", "--help", "--dry-run", "--", "x")
  assert remote(ssh)[1][1:] == ["prog", "--help", "--dry-run", "--", "x"]


def test_logs_dry_run(fake):
  [ssh] = dry(fake, "logs", *POD, "--log=logs/train.log")
  assert "--worker=0" in ssh and "--worker=all" not in ssh
  assert "--zone=us-east5-a" in ssh and "--project=my-proj" in ssh
  script, args = remote(ssh)
  assert "tail -n 100 -F" in script and args == ["logs/train.log"]
  [ssh] = dry(fake, "logs", *POD, "--worker=3")
  assert "--worker=3" in ssh


def test_stop_dry_run(fake):
  [ssh] = dry(fake, "stop", *POD)
  assert ssh[4:6] == ["ssh", "my-pod"] and "--worker=all" in ssh and "--project=my-proj" in ssh
  script, args = remote(ssh)
  assert "kill -TERM" in script and args == ["300"]


def test_delete_dry_run(fake):
  [delete] = dry(fake, "delete", *POD)
  assert delete == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "my-pod",
                    "--zone=us-east5-a", "--project=my-proj", "--quiet"]


def test_dry_run_flag_after_subcommand(fake):
  r = fake.run("delete", "--dry-run", "--name=n", "--zone=z", extra_env={"FAKE_GCLOUD_FORBID": "1"})
  assert r.returncode == 0 and r.stdout.startswith("+ gcloud ") and fake.calls() == []


# ------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("args,reason", [
    ([], "missing subcommand"),
    (["launch", "--name=n", "--zone=z"], "unknown subcommand"),
    (["create", "--name=n", "--zone=z", "--accelerator=v5p-8", "--bogus"], "unknown option"),
    (["delete", "--zone=z"], "missing --name"),
    (["delete", "--name=n"], "missing --zone"),
    (["delete", "--name=", "--zone=z"], "non-empty"),
    (["create", "--name=n", "--zone=z"], "--accelerator"),
    (["create", "--name=n", "--zone=z", "--accelerator=v9x-8"], "--runtime"),
    (["run", "--name=n", "--zone=z"], "command after --"),
    (["run", "--name=n", "--zone=z", "--"], "command after --"),
    (["stop", "--name=n", "--zone=z", "--", "x"], "only accepted by run"),
    (["stop", "extra", "--name=n", "--zone=z"], "unexpected argument"),
    (["logs", "--name=n", "--zone=z", "--worker=all"], "--worker"),
    (["delete", "--name=n", "--zone"], "needs a value"),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_bad_arguments(fake, args, reason, dry_run):
  r = fake.run(*args, dry_run=dry_run, extra_env={"FAKE_GCLOUD_FORBID": "1"})
  assert r.returncode == 2, (r.stdout, r.stderr)
  lines = r.stderr.splitlines()
  assert lines[0] == USAGE and len(lines) == 2 and reason in lines[1], r.stderr
  assert r.stdout == "" and fake.calls() == []


def test_help(fake):
  r = fake.run("--help", extra_env={"FAKE_GCLOUD_FORBID": "1"})
  assert r.returncode == 0 and r.stdout.startswith(USAGE + "\n")
  for sub in ["create", "install", "run", "logs", "stop", "delete"]:
    assert f"\n  {sub} " in r.stdout
  assert fake.calls() == []


# ----------------------------------------------- real runs against the fake
def test_create_reuses_existing_vm(fake):
  r = fake.run("create", *POD, extra_env={"FAKE_DESCRIBE": "READY\tv5p-32"})
  assert r.returncode == 0, r.stderr
  [describe] = fake.calls()
  assert describe[3:5] == ["describe", "my-pod"]
  assert "already exists" in r.stderr and "reusing" in r.stderr and "READY" in r.stderr
  assert "warning" not in r.stderr


def test_create_warns_on_other_accelerator(fake):
  r = fake.run("create", *POD, extra_env={"FAKE_DESCRIBE": "READY\tv5p-8"})
  assert r.returncode == 0 and "warning" in r.stderr and "v5p-8" in r.stderr
  assert len(fake.calls()) == 1


def test_create_replaces_preempted_vm(fake):
  r = fake.run("create", *POD, "--spot", extra_env={"FAKE_DESCRIBE": "PREEMPTED\tv5p-32"})
  assert r.returncode == 0, r.stderr
  assert "preempted" in r.stderr
  assert [c[3] for c in fake.calls()] == ["describe", "delete", "create"]
  assert "--spot" in fake.calls()[2] and "--quiet" in fake.calls()[1]


def test_create_new_vm(fake):
  r = fake.run("create", *POD, "--spot")
  assert r.returncode == 0, r.stderr
  describe, create = fake.calls()
  assert describe[3] == "describe"
  assert create == ["compute", "tpus", "tpu-vm", "create", "my-pod", "--zone=us-east5-a",
                    "--project=my-proj", "--accelerator-type=v5p-32", "--version=v2-alpha-tpuv5", "--spot"]


def test_delete_runs_gcloud(fake):
  r = fake.run("delete", "--name=n", "--zone=z")
  assert r.returncode == 0, r.stderr
  assert fake.calls() == [["compute", "tpus", "tpu-vm", "delete", "n", "--zone=z", "--quiet"]]


def test_missing_gcloud_is_reported(fake, tmp_path):
  env = {"PATH": "/nonexistent"}
  r = subprocess.run(["/bin/bash", str(SCRIPT), "delete", "--name=n", "--zone=z"],
                     env=env, capture_output=True, text=True, timeout=30, check=False)
  assert r.returncode == 1 and "gcloud not found" in r.stderr


def _wait_for(predicate, timeout=15.0):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(0.05)
  return False


def _fake_venv(home: pathlib.Path) -> None:
  venv_bin = home / "rlver_jax" / ".venv" / "bin"
  venv_bin.mkdir(parents=True)
  (venv_bin / "activate").write_text("export RLVER_FAKE_VENV=1\n")


def test_run_and_stop_on_fake_worker(fake, tmp_path):
  """The job gets exactly the argv given, in ~/rlver_jax, with the venv active; stop SIGTERMs it."""
  _fake_venv(fake.home)
  out = tmp_path / "argv.json"
  marker = tmp_path / "got_sigterm"
  job = textwrap.dedent("""
      import json, os, signal, sys, time
      def on_term(signum, frame):
        open(sys.argv[2], "w").write("checkpoint")
        sys.exit(0)
      signal.signal(signal.SIGTERM, on_term)
      json.dump({"argv": sys.argv[3:], "cwd": os.getcwd(), "venv": os.environ.get("RLVER_FAKE_VENV")},
                open(sys.argv[1] + ".tmp", "w"))
      os.rename(sys.argv[1] + ".tmp", sys.argv[1])
      print("job started", flush=True)
      time.sleep(60)
  """)
  words = [*AWKWARD, "multi\nline"]
  r = fake.run("run", "--name=n", "--zone=z", "--", sys.executable, "-c", job, str(out), str(marker), *words)
  assert r.returncode == 0, r.stderr
  assert "started pid" in r.stdout
  assert _wait_for(out.exists), (fake.home / "rlver_jax" / "run.log").read_text()
  got = json.loads(out.read_text())
  assert got == {"argv": words, "cwd": str(fake.home / "rlver_jax"), "venv": "1"}
  assert not (fake.home / "pwned").exists() and not (REPO / "pwned").exists()
  pid_file = fake.home / "rlver_jax" / "run.pid"
  pid = int(pid_file.read_text())
  assert _wait_for(lambda: "job started" in (fake.home / "rlver_jax" / "run.log").read_text())

  # A second run while the job is alive is refused.
  again = fake.run("run", "--name=n", "--zone=z", "--", "true")
  assert again.returncode != 0 and "already running" in again.stderr
  assert int(pid_file.read_text()) == pid

  r = fake.run("stop", "--name=n", "--zone=z")
  assert r.returncode == 0, r.stderr
  assert "exited" in r.stdout
  assert marker.read_text() == "checkpoint"
  assert not pid_file.exists()
  assert "no running job" in fake.run("stop", "--name=n", "--zone=z").stdout
  assert [c[3] for c in fake.calls()] == ["ssh"] * 4
  assert all("--worker=all" in c for c in fake.calls())


def test_a_preempted_job_is_started_again_and_a_finished_one_is_not(fake, tmp_path):
  """Exit 75 ("preempted; run the same command to resume") re-runs the same argv; 0 ends the loop."""
  _fake_venv(fake.home)
  runs = tmp_path / "runs"
  job = ("import sys; f = open(sys.argv[1], 'a'); f.write('x'); f.close(); "
         "sys.exit(75 if open(sys.argv[1]).read() != 'xxx' else 0)")
  r = fake.run("run", "--name=n", "--zone=z", "--", sys.executable, "-c", job, str(runs))
  assert r.returncode == 0, r.stderr
  log = fake.home / "rlver_jax" / "run.log"
  pid_file = fake.home / "rlver_jax" / "run.pid"
  assert _wait_for(lambda: runs.exists() and runs.read_text() == "xxx"), \
      log.read_text() if log.exists() else "no log"
  pid = int(pid_file.read_text())
  assert _wait_for(lambda: not _alive(pid))  # the loop ended with the run that finished
  assert log.read_text().count("exit 75 (preempted): running the same command again") == 2


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  stat = pathlib.Path(f"/proc/{pid}/stat")
  return not (stat.exists() and stat.read_text().split()[2] == "Z")


def test_run_custom_log_path(fake, tmp_path):
  _fake_venv(fake.home)
  r = fake.run("run", "--name=n", "--zone=z", "--log=logs/a b.log", "--", "echo", "hello world")
  assert r.returncode == 0, r.stderr
  log = fake.home / "rlver_jax" / "logs" / "a b.log"
  assert _wait_for(lambda: log.exists() and "hello world\n" in log.read_text())


def test_run_without_install_fails(fake):
  (fake.home / "rlver_jax").mkdir()
  r = fake.run("run", "--name=n", "--zone=z", "--", "true")
  assert r.returncode != 0 and "run install first" in r.stderr


def _git(repo, *args, env):
  return subprocess.run(["git", "-C", str(repo), *args], env=env, check=True,
                        capture_output=True, text=True).stdout.strip()


def _make_repo(path: pathlib.Path, env) -> pathlib.Path:
  path.mkdir(parents=True)
  subprocess.run(["git", "init", "-q", "-b", "main", str(path)], env=env, check=True)
  (path / "VERSION").write_text("1\n")
  _git(path, "add", "VERSION", env=env)
  _git(path, "commit", "-q", "-m", "one", env=env)
  _git(path, "tag", "v1", env=env)
  return path


def _fake_python(bin_dir: pathlib.Path) -> None:
  """A `python3` whose `-m venv DIR` makes a venv whose python records pip calls."""
  venv_python = '#!/bin/sh\necho "$PWD $*" >>"$HOME/pip_calls"\n'
  (bin_dir / "venv_python").write_text(venv_python)
  _write_exe(bin_dir / "python3", (
      "#!/bin/sh\n"
      'case "$1" in\n'
      "  -c) exit 0 ;;\n"
      '  -m) [ "$2" = venv ] || exit 1\n'
      '      mkdir -p "$3/bin"\n'
      f'      cp {shlex.quote(str(bin_dir / "venv_python"))} "$3/bin/python"\n'
      '      chmod +x "$3/bin/python"\n'
      '      : >"$3/bin/activate"\n'
      "      exit 0 ;;\n"
      "esac\n"
      "exit 1\n"))


def test_install_from_local_checkout(fake, tmp_path):
  """install ships a bundle, clones it at --ref, makes the venv, pip-installs; a re-install updates."""
  repo = _make_repo(tmp_path / "src", fake.env)
  _fake_python(fake.bin)
  r = fake.run("install", "--name=n", "--zone=z", f"--repo={repo}")
  assert r.returncode == 0, r.stderr
  checkout = fake.home / "rlver_jax"
  assert (checkout / "VERSION").read_text() == "1\n"
  assert "installed" in r.stdout
  pip_calls = (fake.home / "pip_calls").read_text().splitlines()
  assert pip_calls[-1] == f"{checkout} -m pip install --quiet -e .[tpu]"
  verbs = [c[3] for c in fake.calls()]
  assert verbs == ["scp", "ssh"]
  assert not list(tmp_path.glob("rlver_jax_bundle.*")), "the local bundle was not cleaned up"

  # New commit on main: a re-install updates the checkout in place.
  (repo / "VERSION").write_text("2\n")
  _git(repo, "commit", "-q", "-am", "two", env=fake.env)
  r = fake.run("install", "--name=n", "--zone=z", f"--repo={repo}")
  assert r.returncode == 0, r.stderr
  assert (checkout / "VERSION").read_text() == "2\n"
  assert _git(checkout, "rev-parse", "HEAD", env=fake.env) == _git(repo, "rev-parse", "main", env=fake.env)

  # A tag, then a bare commit id.
  r = fake.run("install", "--name=n", "--zone=z", f"--repo={repo}", "--ref=v1")
  assert r.returncode == 0, r.stderr
  assert (checkout / "VERSION").read_text() == "1\n"
  head = _git(repo, "rev-parse", "main", env=fake.env)
  r = fake.run("install", "--name=n", "--zone=z", f"--repo={repo}", f"--ref={head}")
  assert r.returncode == 0, r.stderr
  assert (checkout / "VERSION").read_text() == "2\n"


def test_install_from_url_and_bad_ref(fake, tmp_path):
  """A --repo that is not a local directory is cloned by the worker itself."""
  repo = _make_repo(tmp_path / "src", fake.env)
  _fake_python(fake.bin)
  url = f"file://{repo}"
  r = fake.run("install", "--name=n", "--zone=z", f"--repo={url}", "--ref=v1")
  assert r.returncode == 0, r.stderr
  assert [c[3] for c in fake.calls()] == ["ssh"]
  assert _git(fake.home / "rlver_jax", "remote", "get-url", "origin", env=fake.env) == url
  r = fake.run("install", "--name=n", "--zone=z", f"--repo={url}", "--ref=no-such-ref")
  assert r.returncode != 0 and "no-such-ref not found" in r.stderr


def test_install_local_repo_bad_ref(fake, tmp_path):
  repo = _make_repo(tmp_path / "src", fake.env)
  r = fake.run("install", "--name=n", "--zone=z", f"--repo={repo}", "--ref=nope")
  assert r.returncode == 1 and "--ref=nope" in r.stderr and fake.calls() == []


def test_logs_follows_log_on_fake_worker(fake):
  log = fake.home / "rlver_jax" / "run.log"
  log.parent.mkdir()
  log.write_text("step 1\nstep 2\n")
  proc = subprocess.Popen([str(SCRIPT), "logs", "--name=n", "--zone=z"], env=fake.env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
  # tail -F never ends: SIGTERM its process group when done, or after 30 s should a read hang.
  stop = lambda: _killpg_quietly(proc.pid, signal.SIGTERM)
  watchdog = threading.Timer(30, stop)
  watchdog.start()
  try:
    assert proc.stdout.readline() == "step 1\n"
    assert proc.stdout.readline() == "step 2\n"
    with log.open("a") as f:
      f.write("step 3\n")
    assert proc.stdout.readline() == "step 3\n"
  finally:
    watchdog.cancel()
    stop()
    proc.communicate(timeout=10)
  [call] = fake.calls()
  assert call[3] == "ssh" and "--worker=0" in call


@pytest.mark.parametrize("sub", ["install", "run", "logs", "stop"])
def test_remote_scripts_parse(fake, sub):
  extra = {"install": ["--repo=https://example.com/r.git", "--python=python3.12"], "run": ["--", "x"]}
  [*_, ssh] = dry(fake, sub, "--name=n", "--zone=z", *extra.get(sub, []))
  script, args = remote(ssh)
  if sub == "install":
    assert args == ["https://example.com/r.git", "main", "python3.12"]
  r = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True, check=False)
  assert r.returncode == 0, r.stderr


def _documented_runs(text: str) -> list[str]:
  """Each `python -m rlver_jax.main` command in a Markdown file, continuation lines joined."""
  joined = text.replace("\\\n", " ")
  return [line[line.index("python -m rlver_jax.main"):] for line in joined.splitlines()
          if "python -m rlver_jax.main" in line and "gs://" in line]


@pytest.mark.parametrize("doc", ["launch/README.md", "README.md"])
def test_documented_pod_runs_override_every_placeholder(doc):
  # The shipped configs point every path at gs://YOUR_BUCKET; a documented run on a bucket must
  # override each such key, or it fails on a placeholder path.
  sys.path.insert(0, str(REPO / "configs"))
  import base
  config = base.get_base_config("grpo", think=True, arg=None)
  placeholders = {f"{section}.{key}" for section, sub in config.items() if hasattr(sub, "items")
                  for key, value in sub.items() if isinstance(value, str) and "YOUR_BUCKET" in value}
  assert placeholders >= {"policy.checkpoint", "simulator.checkpoint", "data.profiles"}
  runs = _documented_runs((REPO / doc).read_text())
  assert runs, f"no pod run command found in {doc}"
  for cmd in runs:
    missing = sorted(k for k in placeholders if f"--config.{k}=" not in cmd)
    assert not missing, f"{doc}: {cmd!r} leaves {missing} at gs://YOUR_BUCKET"
