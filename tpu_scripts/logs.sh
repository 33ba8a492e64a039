#!/usr/bin/env bash
# Follow the training log of worker WORKER (default 0); Ctrl-C stops following, not the run.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

on_workers "${WORKER:-0}" "tail -n 100 -F $REMOTE_LOG"
