# shellcheck shell=bash
# Sourced by every tpu_scripts/*.sh: the settings (env.sh), `run` (prints the command when
# DRY_RUN=1, else runs it), the TPU generation -> runtime image map and the gcloud wrappers.
set -euo pipefail
# shellcheck source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
: "${TPU_PROJECT:?set TPU_PROJECT to your Google Cloud project id (tpu_scripts/env.sh)}"
: "${TPU_ZONE:?set TPU_ZONE to a zone with quota for $TPU_TYPE, e.g. us-east5-a (tpu_scripts/env.sh)}"

# shellcheck disable=SC2034 # both used by the scripts that source this file
REMOTE_DIR=jaxrl4llm              # the clone on every worker, relative to its home directory
# shellcheck disable=SC2034
TRAIN_PATTERN='[j]axrl4llm train' # pgrep/pkill -f pattern; [j] keeps it from matching the shell that runs it
# shellcheck disable=SC2034
SUPERVISE_PATTERN='tpu_scripts/[s]upervise.sh' # the same for launch.sh's supervisor

# q WORD: WORD quoted for the remote shell (printf %q).
q() { printf '%q' "$1"; }
# shellcheck disable=SC2034,SC2088 # the remote shell expands ~ (each worker's home)
REMOTE_LOG="~/$(q "$RUN_LOG")"

# One word, shell-quoted for reading: as is when it is plain, else in single quotes.
quote() {
  if [[ $1 =~ ^[[:alnum:]_./:=@%+,-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}

# run CMD ARGS...: with DRY_RUN=1 print the command on one line after "+ ", else run it.
run() {
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '+'
    local word
    for word in "$@"; do printf ' %s' "$(quote "$word")"; done
    printf '\n'
  else
    "$@"
  fi
}

# runtime_for TPU_TYPE: the TPU VM runtime image of the type's generation (v5p-128 -> v2-alpha-tpuv5).
runtime_for() {
  case ${1%%-*} in
    v2 | v3 | v4) echo tpu-ubuntu2204-base ;;
    v5litepod) echo v2-alpha-tpuv5-lite ;;
    v5p) echo v2-alpha-tpuv5 ;;
    v6e) echo v2-alpha-tpuv6e ;;
    *)
      echo "unknown TPU generation in TPU_TYPE=$1; valid: v2-*, v3-*, v4-*, v5litepod-* (v5e), v5p-*, v6e-*; or set TPU_RUNTIME" >&2
      return 1
      ;;
  esac
}

# tpu_vm VERB [FLAGS...]: gcloud compute tpus tpu-vm VERB on the slice TPU_NAME.
tpu_vm() {
  local verb=$1
  shift
  run gcloud compute tpus tpu-vm "$verb" "$TPU_NAME" --project="$TPU_PROJECT" --zone="$TPU_ZONE" "$@"
}

# on_workers WORKER COMMAND: run a shell command (one line) on worker WORKER (a number or all).
on_workers() {
  tpu_vm ssh --worker="$1" --command="$2"
}
