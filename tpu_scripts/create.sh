#!/usr/bin/env bash
# Create the TPU VM slice TPU_NAME of type TPU_TYPE; extra arguments go to gcloud (e.g. --spot).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

runtime=${TPU_RUNTIME:-$(runtime_for "$TPU_TYPE")}
tpu_vm create --accelerator-type="$TPU_TYPE" --version="$runtime" \
  --scopes=https://www.googleapis.com/auth/cloud-platform "$@"
