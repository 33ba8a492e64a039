#!/usr/bin/env bash
# Start `jaxrl4llm train ARGS...` on every worker, detached from ssh, logging to ~/$RUN_LOG.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ $# == 0 ]]; then
  echo "usage: $0 [--resume] -c CONFIG.yaml ... KEY=VALUE ...  (the arguments of jaxrl4llm train)" >&2
  exit 2
fi
args=$(printf ' %q' "$@")
on_workers all "cd $REMOTE_DIR && JAXRL4LLM_DISTRIBUTED=1 setsid nohup .venv/bin/jaxrl4llm train$args >> $REMOTE_LOG 2>&1 < /dev/null &"
echo "started on every worker of $TPU_NAME; follow worker 0 with tpu_scripts/logs.sh" >&2
