#!/usr/bin/env bash
# Delete the TPU VM pod slice.
set -euo pipefail
gcloud compute tpus tpu-vm delete "$TPU_NAME" --project "$TPU_PROJECT" --zone "$TPU_ZONE" --quiet
