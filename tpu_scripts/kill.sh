#!/usr/bin/env bash
# Stop the run on every worker (SIGTERM, SIGKILL after 30 s); the slice is kept.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

p="'$TRAIN_PATTERN'"
on_workers all "pkill -TERM -f $p || true; for _ in \$(seq 30); do pgrep -f $p > /dev/null || exit 0; sleep 1; done; pkill -KILL -f $p || true"
