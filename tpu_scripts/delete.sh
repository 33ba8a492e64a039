#!/usr/bin/env bash
# Delete the slice TPU_NAME (asks first unless YES=1).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ ${DRY_RUN:-0} != 1 && ${YES:-0} != 1 ]]; then
  answer=
  read -r -p "Delete the TPU slice $TPU_NAME ($TPU_TYPE, $TPU_PROJECT/$TPU_ZONE)? [y/N] " answer || true
  [[ $answer == [yY]* ]] || { echo "not deleted" >&2; exit 1; }
fi
tpu_vm delete --quiet
