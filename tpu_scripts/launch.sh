#!/usr/bin/env bash
# Start `jaxrl4llm train ARGS... --resume auto` on every worker under tpu_scripts/supervise.sh
# (which relaunches it after a preemption or a crash, a bounded number of times), detached from
# ssh, logging to ~/$RUN_LOG. A worker whose supervisor still runs keeps it (a lock file): after
# a host comes back (a maintenance event), running launch.sh again restarts only the missing ones.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ $# == 0 ]]; then
  echo "usage: $0 -c CONFIG.yaml ... KEY=VALUE ...  (the arguments of jaxrl4llm train; --resume auto is added)" >&2
  exit 2
fi
args=$(printf ' %q' "$@")
on_workers all "cd $REMOTE_DIR && JAXRL4LLM_DISTRIBUTED=1 JAXRL4LLM_MAX_RESTARTS=$(q "$MAX_RESTARTS") setsid nohup tpu_scripts/supervise.sh$args >> $REMOTE_LOG 2>&1 < /dev/null &"
echo "started on every worker of $TPU_NAME; follow worker 0 with tpu_scripts/logs.sh" >&2
