#!/usr/bin/env bash
# On every host of the slice: clone jaxrl4llm, create a venv, install jax[tpu] and the package.
set -euo pipefail
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project "$TPU_PROJECT" --zone "$TPU_ZONE" --worker=all --command "
  set -e
  [ -d jaxrl4llm ] || git clone $JAXRL4LLM_REPO jaxrl4llm
  cd jaxrl4llm && git fetch -q && git checkout -q $JAXRL4LLM_REF
  python3 -m venv .venv && .venv/bin/pip install -q -U pip
  .venv/bin/pip install -q 'jax[tpu]' && .venv/bin/pip install -q -e .
"
