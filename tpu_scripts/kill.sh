#!/usr/bin/env bash
# Stop the run on every worker: its supervisor first (no relaunch), then SIGTERM (the step in
# progress ends and is saved), SIGKILL after KILL_AFTER seconds (default 30); the slice is kept.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

p="'$TRAIN_PATTERN'"
on_workers all "pkill -TERM -f '$SUPERVISE_PATTERN' || true; pkill -TERM -f $p || true; for _ in \$(seq $(q "${KILL_AFTER:-30}")); do pgrep -f $p > /dev/null || exit 0; sleep 1; done; pkill -KILL -f $p || true"
