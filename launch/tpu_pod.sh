#!/usr/bin/env bash
# Manage a Cloud TPU VM (single host or pod slice) for rlver_jax: create it,
# install the package on every worker, start a training command on every
# worker, follow its log, stop it, delete the VM.  Run with --help for details.
#
# Written for bash >= 3.2 (the one macOS ships): no associative arrays, no
# ${var@Q}, and empty arrays are never expanded bare under `set -u`.
# On the workers only bash, git, ps, setsid and nohup are assumed.
set -euo pipefail

readonly PROG="launch/tpu_pod.sh"
readonly USAGE="usage: ${PROG} [--dry-run] {create,install,run,logs,stop,delete} --name=NAME --zone=ZONE --accelerator=TYPE [--project=P] [--spot] [-- COMMAND ...]"
# The checkout, its venv, the default log and run.pid live in ~/rlver_jax on
# each worker.  `~` is expanded there, not here.
# shellcheck disable=SC2088
readonly DEFAULT_LOG='~/rlver_jax/run.log'
# How long `stop` waits for the job to exit after SIGTERM (it saves a checkpoint).
readonly STOP_WAIT_S=300

usage_error() {
  printf '%s\n' "$USAGE" >&2
  printf '%s: error: %s\n' "$PROG" "$1" >&2
  exit 2
}

die() {
  printf '%s: error: %s\n' "$PROG" "$1" >&2
  exit 1
}

print_help() {
  cat <<EOF
$USAGE

Manage a Cloud TPU VM (one host or a multi-host pod slice) for rlver_jax.

subcommands:
  create    create the TPU VM; one that already exists is reused, except a
            preempted one, which is deleted and created again
  install   on every worker: clone or update the repository at --ref into
            ~/rlver_jax, create ~/rlver_jax/.venv, pip install -e '.[tpu]'
  run       on every worker: start COMMAND (the words after --) in the
            background with nohup, inside ~/rlver_jax with the venv active;
            output goes to --log, the pid to ~/rlver_jax/run.pid; when
            COMMAND exits with 75 (the trainer was preempted by a SIGTERM
            that did not come from stop) it is started again
  logs      follow the log of worker 0 (tail -F; Ctrl-C to leave)
  stop      on every worker: SIGTERM the job started by run (its whole
            process group) and wait up to ${STOP_WAIT_S}s for it to exit
  delete    delete the TPU VM

options:
  --dry-run             print each command (prefixed with '+ ') instead of running it
  --name=NAME           TPU VM name (required)
  --zone=ZONE           zone, e.g. us-east5-a (required)
  --accelerator=TYPE    accelerator type, e.g. v5p-32, v5litepod-16, v6e-8, v4-8
                        (required by create)
  --project=P           Google Cloud project (default: gcloud's configured project)
  --spot                create a Spot (preemptible) TPU VM
  --runtime=VERSION     TPU VM software version (default by generation:
                        v5p: v2-alpha-tpuv5, v5litepod/v5e: v2-alpha-tpuv5-lite,
                        v6e: v2-alpha-tpuv6e, v2/v3/v4: tpu-ubuntu2204-base)
  --repo=URL_OR_PATH    repository to install (default: this checkout's
                        'origin' remote); a local directory is sent to the
                        workers as a git bundle of its commits (uncommitted
                        changes are not included)
  --ref=GIT_REF         branch, tag or commit to install (default: main)
  --python=EXE          interpreter for the venv on the workers (default: the
                        first Python >= 3.12 found, else python3.12 via apt)
  --log=PATH            log file on the workers (default: ${DEFAULT_LOG};
                        relative paths are relative to ~/rlver_jax)
  --worker=N            worker whose log 'logs' follows (default: 0)
  -h, --help            show this help and exit

On a pod slice every worker runs the same command; jax.distributed.initialize()
(called by the program itself) discovers the slice topology.  COMMAND is run
as an argument vector, not through a shell: every word arrives as given.
EOF
}

# q WORD: WORD quoted for a POSIX shell (bare when it needs no quoting).  Single
# quotes are used rather than printf %q, whose $'...' form is bash-only.
q() {
  local s=$1 out="'" sq="'" esc="'\\''"
  case $s in
    '' | *[!A-Za-z0-9_@%+=:,./-]*) ;;
    *) printf '%s' "$s"; return ;;
  esac
  while [[ $s == *"$sq"* ]]; do
    out+="${s%%"$sq"*}$esc"
    s=${s#*"$sq"}
  done
  printf '%s' "$out$s'"
}

# qjoin WORD...: the words quoted and joined with spaces.
qjoin() {
  local sep="" w
  for w in "$@"; do
    printf '%s%s' "$sep" "$(q "$w")"
    sep=" "
  done
}

# show WORD...: print a command the way --dry-run does.
show() {
  printf '+ %s\n' "$(qjoin "$@")"
}

# do_cmd WORD...: run a command, or only print it under --dry-run.
do_cmd() {
  if ((dry_run)); then
    show "$@"
  else
    show "$@" >&2
    "$@"
  fi
}

default_runtime() {
  case $1 in
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v5litepod-* | v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    v2-* | v3-* | v4-*) echo "tpu-ubuntu2204-base" ;;
    *) return 1 ;;
  esac
}

# ---------------------------------------------------------------- arguments
dry_run=0
spot=0
subcommand=""
name=""
zone=""
accelerator=""
project=""
runtime=""
repo=""
ref="main"
python_exe=""
log="$DEFAULT_LOG"
worker="0"
have_dashdash=0
user_cmd=()

while (($#)); do
  arg=$1
  shift
  case $arg in
    --)
      have_dashdash=1
      user_cmd=("$@")
      break
      ;;
    -h | --help)
      print_help
      exit 0
      ;;
    --dry-run) dry_run=1 ;;
    --spot) spot=1 ;;
    --name | --zone | --accelerator | --project | --runtime | --repo | --ref | --python | --log | --worker | \
      --name=* | --zone=* | --accelerator=* | --project=* | --runtime=* | --repo=* | --ref=* | --python=* | --log=* | --worker=*)
      if [[ $arg == *=* ]]; then
        key=${arg%%=*}
        value=${arg#*=}
      else
        key=$arg
        (($#)) || usage_error "option ${key} needs a value"
        value=$1
        shift
      fi
      [[ -n $value ]] || usage_error "option ${key} needs a non-empty value"
      case $key in
        --name) name=$value ;;
        --zone) zone=$value ;;
        --accelerator) accelerator=$value ;;
        --project) project=$value ;;
        --runtime) runtime=$value ;;
        --repo) repo=$value ;;
        --ref) ref=$value ;;
        --python) python_exe=$value ;;
        --log) log=$value ;;
        --worker) worker=$value ;;
      esac
      ;;
    -*) usage_error "unknown option: ${arg}" ;;
    *)
      [[ -z $subcommand ]] || usage_error "unexpected argument: ${arg}"
      subcommand=$arg
      ;;
  esac
done

[[ -n $subcommand ]] || usage_error "missing subcommand"
case $subcommand in
  create | install | run | logs | stop | delete) ;;
  *) usage_error "unknown subcommand: ${subcommand}" ;;
esac
[[ -n $name ]] || usage_error "missing --name"
[[ -n $zone ]] || usage_error "missing --zone"
if [[ $subcommand == create ]]; then
  [[ -n $accelerator ]] || usage_error "create needs --accelerator"
  if [[ -z $runtime ]]; then
    runtime=$(default_runtime "$accelerator") ||
      usage_error "no default runtime for accelerator '${accelerator}'; pass --runtime=VERSION"
  fi
fi
if [[ $subcommand == run ]]; then
  ((${#user_cmd[@]})) || usage_error "run needs a command after --"
elif ((have_dashdash)); then
  usage_error "a command after -- is only accepted by run"
fi
[[ $worker =~ ^[0-9]+$ ]] || usage_error "--worker must be a worker number"

if ! ((dry_run)); then
  command -v gcloud >/dev/null 2>&1 || die "gcloud not found on PATH (install the Google Cloud CLI)"
fi

# Flags common to every gcloud call on this TPU VM.
loc_flags=("--zone=${zone}")
[[ -z $project ]] || loc_flags+=("--project=${project}")

# ------------------------------------------------------- scripts for workers
# Each runs as `bash -c SCRIPT NAME ARG...`: the script is a constant and all
# data (paths, refs, the job's words) travel as separately quoted arguments.
# They are written one statement per line, every line ending in `;` or a
# keyword, so that flat() can join them into one line for --command.

# flat VAR: collapse the newlines and indentation of $VAR to single spaces.
flat() {
  local out="" line
  while IFS= read -r line; do
    line=${line#"${line%%[![:space:]]*}"}
    if [[ -n $line ]]; then out+="${out:+ }${line}"; fi
  done <<<"${!1}"
  printf -v "$1" '%s' "$out"
}

# Shared by run and stop: is the process with pid $1 alive (and not a zombie)?
# shellcheck disable=SC2016
readonly ALIVE_FN='alive() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) || return 1; case $s in *Z*) return 1 ;; esac; };'
# Turns $log (~/..., absolute, or relative to ~/rlver_jax) into an absolute path.
# shellcheck disable=SC2016
# The job runs under a loop that starts it again when it exits with 75, the trainer's "preempted,
# run the same command to resume" status, unless the loop itself got SIGTERM (stop, or the VM
# shutting down): the trap only runs once the job has exited, so stop still waits for its save.
# shellcheck disable=SC2016
readonly RETRY_LOOP_LINE='retry_loop='"'"'stopped=0; trap "stopped=1" TERM; while :; do "$@"; rc=$?; if [ "$rc" -ne 75 ] || [ "$stopped" -eq 1 ]; then exit "$rc"; fi; echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) exit 75 (preempted): running the same command again"; done'"'"';'
readonly LOG_PATH_LINE='case $log in "~/"*) log="$HOME/${log#"~/"}" ;; /*) ;; *) log="$HOME/rlver_jax/$log" ;; esac;'

# install REPO REF PYTHON: clone or update ~/rlver_jax at REF, make its venv,
# pip install -e '.[tpu]'.  The pinned jax needs Python >= 3.12; the TPU base
# images ship 3.10, so python3.12 comes from apt when no newer one is present
# (Ubuntu 22.04 images have it only in the deadsnakes PPA, added then).
# shellcheck disable=SC2016
INSTALL_SCRIPT='
set -euo pipefail;
repo=$1; ref=$2; py=$3; dir="$HOME/rlver_jax"; host=$(hostname);
export GIT_TERMINAL_PROMPT=0;
case $repo in "~/"*) repo="$HOME/${repo#"~/"}" ;; esac;
if [ -d "$dir/.git" ]; then
  git -C "$dir" remote set-url origin "$repo";
elif [ -e "$dir" ]; then
  echo "$host: $dir exists and is not a git checkout; move it away first" >&2;
  exit 1;
else
  git clone --quiet --no-checkout "$repo" "$dir";
fi;
git -C "$dir" fetch --quiet --force --tags origin "+refs/heads/*:refs/remotes/origin/*";
if commit=$(git -C "$dir" rev-parse --verify --quiet "refs/remotes/origin/$ref^{commit}"); then :;
elif commit=$(git -C "$dir" rev-parse --verify --quiet "$ref^{commit}"); then :;
elif git -C "$dir" fetch --quiet origin "$ref" 2>/dev/null &&
  commit=$(git -C "$dir" rev-parse --verify --quiet "FETCH_HEAD^{commit}"); then :;
else
  echo "$host: ref $ref not found in $repo" >&2;
  exit 1;
fi;
git -C "$dir" checkout --quiet --force --detach "$commit";
py_ok() { "$1" -c "import sys; sys.exit(sys.version_info < (3, 12))" 2>/dev/null; };
apt_install() { sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"; };
if [ -z "$py" ]; then
  for c in python3 python3.14 python3.13 python3.12; do
    if command -v "$c" >/dev/null 2>&1 && py_ok "$c"; then py=$c; break; fi;
  done;
fi;
if [ -z "$py" ]; then
  apt_install python3.12 python3.12-venv ||
    { sudo add-apt-repository -y ppa:deadsnakes/ppa && apt_install python3.12 python3.12-venv; };
  py=python3.12;
fi;
if [ ! -x "$dir/.venv/bin/python" ] && ! "$py" -m venv "$dir/.venv"; then
  rm -rf "$dir/.venv";
  apt_install "${py##*/}-venv";
  "$py" -m venv "$dir/.venv";
fi;
cd "$dir";
.venv/bin/python -m pip install --quiet --upgrade pip;
.venv/bin/python -m pip install --quiet -e ".[tpu]";
echo "$host: installed $(git rev-parse --short HEAD) ($ref) into $dir";
'
flat INSTALL_SCRIPT
readonly INSTALL_SCRIPT

# run LOG WORD...: start WORD... detached (own session, nohup, stdin closed)
# in ~/rlver_jax with the venv active, appending to LOG; its pid (= process
# group id) goes to ~/rlver_jax/run.pid.
# shellcheck disable=SC2016
RUN_SCRIPT="
set -euo pipefail;
${ALIVE_FN}
"'log=$1; shift;
cd "$HOME/rlver_jax";
host=$(hostname);
'"${LOG_PATH_LINE}${RETRY_LOOP_LINE}"'
if [ -s run.pid ] && alive "$(cat run.pid)"; then
  echo "$host: a job is already running (pid $(cat run.pid)); stop it first" >&2;
  exit 1;
fi;
if [ ! -f .venv/bin/activate ]; then
  echo "$host: no venv in $PWD; run install first" >&2;
  exit 1;
fi;
. .venv/bin/activate;
mkdir -p "$(dirname "$log")";
echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) $host: $*" >>"$log";
setsid nohup bash -c "$retry_loop" rlver_retry "$@" >>"$log" 2>&1 </dev/null &
echo $! >run.pid;
echo "$host: started pid $!, log $log";
'
flat RUN_SCRIPT
readonly RUN_SCRIPT

# logs LOG: follow LOG.
# shellcheck disable=SC2016
LOGS_SCRIPT='
set -eu;
log=$1;
cd "$HOME/rlver_jax";
'"${LOG_PATH_LINE}"'
exec tail -n 100 -F "$log";
'
flat LOGS_SCRIPT
readonly LOGS_SCRIPT

# stop WAIT_S: SIGTERM the process group in ~/rlver_jax/run.pid and wait up
# to WAIT_S seconds for the job to exit.
# shellcheck disable=SC2016
STOP_SCRIPT="
set -eu;
${ALIVE_FN}
"'wait_s=$1; host=$(hostname); pidfile="$HOME/rlver_jax/run.pid";
if [ ! -s "$pidfile" ] || ! alive "$(cat "$pidfile")"; then
  echo "$host: no running job";
  rm -f "$pidfile";
  exit 0;
fi;
pid=$(cat "$pidfile");
kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid";
echo "$host: sent SIGTERM to job $pid, waiting for it to exit";
waited=0;
while alive "$pid"; do
  if [ "$waited" -ge "$wait_s" ]; then
    echo "$host: job $pid still running after ${waited}s (kill -KILL -- -$pid to force)" >&2;
    exit 1;
  fi;
  sleep 1;
  waited=$((waited + 1));
done;
rm -f "$pidfile";
echo "$host: job $pid exited";
'
flat STOP_SCRIPT
readonly STOP_SCRIPT

# tpu_ssh WORKER SCRIPT NAME ARG...: run `bash -c SCRIPT NAME ARG...` on the
# given worker(s).
tpu_ssh() {
  local worker_sel=$1
  shift
  do_cmd gcloud compute tpus tpu-vm ssh "$name" "${loc_flags[@]}" "--worker=${worker_sel}" \
    "--command=$(qjoin bash -c "$@")"
}

# --------------------------------------------------------------- subcommands
cmd_create() {
  local describe=(gcloud compute tpus tpu-vm describe "$name" "${loc_flags[@]}"
    "--format=value(state,acceleratorType)")
  local create=(gcloud compute tpus tpu-vm create "$name" "${loc_flags[@]}"
    "--accelerator-type=${accelerator}" "--version=${runtime}")
  if ((spot)); then create+=(--spot); fi
  if ((dry_run)); then
    show "${describe[@]}"
    show "${create[@]}"
    return
  fi
  local info state existing_type
  show "${describe[@]}" >&2
  if info=$("${describe[@]}" 2>/dev/null); then
    read -r state existing_type _ <<<"$info" || true
    if [[ ${state:-} == PREEMPTED ]]; then
      # A preempted Spot VM cannot be restarted, only deleted and created anew.
      echo "TPU VM ${name} in ${zone} was preempted; deleting it and creating it again." >&2
      do_cmd gcloud compute tpus tpu-vm delete "$name" "${loc_flags[@]}" --quiet
      show "${create[@]}" >&2
      "${create[@]}"
      return
    fi
    echo "TPU VM ${name} already exists in ${zone} (state: ${state:-unknown}); reusing it." >&2
    if [[ -n ${existing_type:-} && ${existing_type##*/} != "$accelerator" ]]; then
      echo "warning: its accelerator type is ${existing_type##*/}, not ${accelerator}." >&2
    fi
    return
  fi
  show "${create[@]}" >&2
  "${create[@]}"
}

cmd_install() {
  local remote_repo bundle_dir
  if [[ -z $repo ]]; then
    local here
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    repo=$(git -C "$here" remote get-url origin 2>/dev/null) ||
      usage_error "install needs --repo=URL_OR_PATH (this checkout has no 'origin' remote)"
  fi
  if [[ -d $repo ]]; then
    # A local checkout: ship its commits to the workers as a git bundle.
    git -C "$repo" rev-parse --git-dir >/dev/null 2>&1 || die "--repo=${repo} is not a git repository"
    git -C "$repo" rev-parse --verify --quiet "${ref}^{commit}" >/dev/null ||
      die "--ref=${ref} is not a commit of ${repo}"
    if ((dry_run)); then
      bundle_dir="${TMPDIR:-/tmp}/rlver_jax_bundle.XXXXXX"
    else
      bundle_dir=$(mktemp -d "${TMPDIR:-/tmp}/rlver_jax_bundle.XXXXXX")
      # shellcheck disable=SC2064  # expand now: bundle_dir is local
      trap "rm -rf $(q "$bundle_dir")" EXIT
    fi
    do_cmd git -C "$repo" bundle create "${bundle_dir}/rlver_jax.bundle" --all
    do_cmd gcloud compute tpus tpu-vm scp "${bundle_dir}/rlver_jax.bundle" "${name}:rlver_jax.bundle" \
      "${loc_flags[@]}" --worker=all
    # shellcheck disable=SC2088  # expanded on the workers
    remote_repo='~/rlver_jax.bundle'
  else
    remote_repo=$repo
  fi
  tpu_ssh all "$INSTALL_SCRIPT" tpu_pod_install "$remote_repo" "$ref" "$python_exe"
}

cmd_run() {
  tpu_ssh all "$RUN_SCRIPT" tpu_pod_run "$log" "${user_cmd[@]}"
}

cmd_logs() {
  tpu_ssh "$worker" "$LOGS_SCRIPT" tpu_pod_logs "$log"
}

cmd_stop() {
  tpu_ssh all "$STOP_SCRIPT" tpu_pod_stop "$STOP_WAIT_S"
}

cmd_delete() {
  do_cmd gcloud compute tpus tpu-vm delete "$name" "${loc_flags[@]}" --quiet
}

"cmd_${subcommand}"
