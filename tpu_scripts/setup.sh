#!/usr/bin/env bash
# On every worker: mount BUCKET at MOUNT with gcsfuse, check out JAXRL4LLM_REF, create a
# Python TPU_PYTHON venv with uv and pip install -e ".[tpu]". Safe to re-run (after a new push).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

apt='sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -q'  # waits for boot-time apt runs
steps=()
if [[ -n $BUCKET ]]; then
  steps+=(
    "{ command -v gcsfuse > /dev/null || { echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -cs) main\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list > /dev/null && curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc > /dev/null && $apt update && $apt install -y gcsfuse; }; }"
    "{ mountpoint -q $(q "$MOUNT") || { sudo mkdir -p $(q "$MOUNT") && sudo chown \"\$(id -u):\$(id -g)\" $(q "$MOUNT") && gcsfuse --implicit-dirs --rename-dir-limit=100000 $(q "$BUCKET") $(q "$MOUNT"); }; }"
  )
fi
steps+=(
  "{ test -d $REMOTE_DIR/.git || git clone -q $(q "$JAXRL4LLM_REPO") $REMOTE_DIR; }"
  "cd $REMOTE_DIR && git fetch -q origin $(q "$JAXRL4LLM_REF") && git checkout -q --detach FETCH_HEAD"
  "{ python3 -m pip --version > /dev/null 2>&1 || { $apt update && $apt install -y python3-pip; }; }"
  "{ python3 -m pip install -q --user -U uv || python3 -m pip install -q --user -U --break-system-packages uv; }"
  "{ test -x .venv/bin/python$(q "$TPU_PYTHON") || { rm -rf .venv && ~/.local/bin/uv venv -q --seed --python $(q "$TPU_PYTHON") .venv; }; }"
  ".venv/bin/pip install -q -U pip && .venv/bin/pip install -q -e '.[tpu]'"
  ".venv/bin/python -c 'import sys, jax, jaxrl4llm; print(\"python\", sys.version.split()[0], \"jax\", jax.__version__)'"
)
script=${steps[0]}
for step in "${steps[@]:1}"; do script+=" && $step"; done
on_workers all "$script"
