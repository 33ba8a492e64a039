#!/usr/bin/env bash
# Start `jaxrl4llm train ARGS...` on every host at once (multi-host jax.distributed).
set -euo pipefail
args=$(printf '%q ' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project "$TPU_PROJECT" --zone "$TPU_ZONE" --worker=all --command "
  cd jaxrl4llm && JAXRL4LLM_DISTRIBUTED=1 nohup .venv/bin/jaxrl4llm train $args > train.log 2>&1 &
"
echo "launched on all hosts; follow with: gcloud compute tpus tpu-vm ssh $TPU_NAME --zone $TPU_ZONE --worker=0 --command 'tail -f jaxrl4llm/train.log'"
