#!/usr/bin/env bash
# Prints the path of a working Python X.Y interpreter (`find_python.sh 3.12`), or exits 1 when there
# is none. Tries `pythonX.Y` on PATH (only if it runs: a pyenv shim without that version installed
# does not), then pyenv's installs ($PYENV_ROOT, ~/.pyenv, /root/.pyenv: versions/X.Y.*/bin/pythonX.Y,
# the newest patch release first).
set -uo pipefail
want=${1:?usage: $0 X.Y}

works() {  # the interpreter runs and is version $want
  [ -n "$1" ] && [ "$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$want" ]
}

candidates=()
if onpath=$(command -v "python$want" 2>/dev/null); then candidates+=("$onpath"); fi
for root in "${PYENV_ROOT:-}" "${HOME:-}/.pyenv" /root/.pyenv; do
  [ -n "$root" ] && [ -d "$root/versions" ] || continue
  while IFS= read -r py; do candidates+=("$py"); done < <(
    find "$root/versions" -mindepth 3 -maxdepth 3 -path "$root/versions/$want.*/bin/python$want" 2>/dev/null | sort -V -r)
done
for py in "${candidates[@]}"; do
  if works "$py"; then
    echo "$py"
    exit 0
  fi
done
exit 1
