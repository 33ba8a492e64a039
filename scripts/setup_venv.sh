#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs jaxrl4llm into it: `setup_venv.sh demo` the package
# alone (what ./scripts/demo needs: no torch, libtpu or jupyter; ~1.4 GB), `setup_venv.sh test`
# (the default) with its test extras too (~3 GB). A venv keeps what it has: the demo after the
# tests installs nothing, the tests after the demo add their extras. Re-installs when
# pyproject.toml changed since the last install or when the tests find a demo-only venv.
# pip's output goes to .venv/install.log; on a failure its tail is printed. --no-compile: pip writes
# no bytecode for the ~20,000 modules it installs (~80 s of a fresh test venv's ~150 s on 2 cores);
# Python writes it at first import for the few hundred a run imports (scripts/test and .ci/run clear
# PYTHONDONTWRITEBYTECODE, so the first process's bytecode serves the others).
# VENV=<folder> and PYTHON=<interpreter> pick another venv and the interpreter that creates it
# (.ci/run: VENV=.venv312 PYTHON=$(scripts/find_python.sh 3.12)); defaults: .venv, python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
want=${1:-test}
case "$want" in
  demo | test) ;;
  *) echo "usage: $0 [demo|test]" >&2; exit 2 ;;
esac
log=$VENV/install.log
# An editable install writes jaxrl4llm.egg-info in this folder: two venvs set up at once (.ci/run's)
# take turns for that step (flock), and install everything else side by side.
editable_lock=.setup_venv.lock

run_logged() {
  if ! "$@" >>"$log" 2>&1; then
    echo "setup failed: $* (full log: $log)" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $("$PY" --version 2>&1) (first run: a few minutes; log: $log)"
  "$PY" -m venv "$VENV"
  run_logged "$VENV/bin/python" -m pip install --upgrade pip
fi
# The stamp holds "<sha256 of pyproject.toml> <demo|test>" (a hash alone: test, an older stamp).
stamp=$VENV/.jaxrl4llm-install-stamp
hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
have_hash="" have=""
if [ -f "$stamp" ]; then read -r have_hash have < "$stamp" || true; fi
if [ -n "$have_hash" ] && [ -z "$have" ]; then have="test"; fi
# Free disk, checked before pip starts: a venv cut short by a full disk is worse than none. torch
# is the large part (~2 GB as a local CPU wheel, ~7 GB as PyPI's CUDA build with its nvidia wheels,
# which is what Python 3.12 gets); jax and the rest take ~1.5 GB.
require_free_gb() {
  local need=$1 what=$2 avail
  avail=$(( $(df -Pk "$VENV" | awk 'NR==2 {print $4}') / 1048576 ))
  if [ "$avail" -lt "$need" ]; then
    echo "setup refused: installing $what into $VENV needs about $need GB free on its disk;" \
         "$avail GB are free ($(df -P "$VENV" | awk 'NR==2 {print $6}')). Free space (old clones" \
         "and venvs, pip's cache: python3 -m pip cache purge) and run it again." >&2
    exit 1
  fi
}
if [ "$have_hash" != "$hash" ] || { [ "$want" = test ] && [ "$have" != test ]; }; then
  if [ "$want" = test ] && ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    require_free_gb 9 "torch (the tests' oracle) and the test extras"
  elif [ ! -f "$stamp" ]; then
    require_free_gb 2 "jaxrl4llm"
  fi
  if [ "$want" = test ]; then
    echo "installing jaxrl4llm and its test extras into $VENV (log: $log)"
    # torch is a test-time oracle only; pinning it keeps pip on the local CPU wheel where there is one
    # (Python 3.11 here; for 3.12 pip takes PyPI's CUDA build, ~3 GB with its nvidia wheels).
    run_logged "$VENV/bin/python" -m pip install --no-compile "torch==2.13.0"
    run_logged flock "$editable_lock" "$VENV/bin/python" -m pip install --no-compile -e ".[test]"
  else
    echo "installing jaxrl4llm into $VENV (log: $log)"
    run_logged flock "$editable_lock" "$VENV/bin/python" -m pip install --no-compile -e .
  fi
  echo "$hash $want" > "$stamp"
fi
