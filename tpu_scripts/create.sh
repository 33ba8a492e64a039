#!/usr/bin/env bash
# Create the TPU VM pod slice described by env.sh.
set -euo pipefail
gcloud compute tpus tpu-vm create "$TPU_NAME" --project "$TPU_PROJECT" --zone "$TPU_ZONE" \
  --accelerator-type "$TPU_TYPE" --version "$TPU_RUNTIME"
