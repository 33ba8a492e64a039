#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs jaxrl4llm with its test extras into it.
# Re-installs only when pyproject.toml changed since the last install. pip's output goes to
# .venv/install.log; on a failure its tail is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
log=.venv/install.log

run_logged() {
  if ! "$@" >>"$log" 2>&1; then
    echo "setup failed: $* (full log: $log)" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
}

if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $("$PY" --version 2>&1) (first run: a few minutes; log: $log)"
  "$PY" -m venv .venv
  run_logged .venv/bin/python -m pip install --upgrade pip
fi
stamp=.venv/.jaxrl4llm-install-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "installing jaxrl4llm and its test extras into .venv (log: $log)"
  # torch (CPU build) is a test-time oracle only; pinning it keeps pip on the local CPU wheel.
  run_logged .venv/bin/python -m pip install "torch==2.13.0"
  run_logged .venv/bin/python -m pip install -e ".[test]"
  echo "$want" > "$stamp"
fi
