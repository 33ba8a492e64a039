# shellcheck shell=bash
# Settings of the TPU scripts: edit the defaults here or set the variables in the environment
# (e.g. `TPU_TYPE=v6e-64 tpu_scripts/create.sh`). tpu_scripts/common.sh sources this file.
export TPU_PROJECT=${TPU_PROJECT:-}          # Google Cloud project id (required)
export TPU_ZONE=${TPU_ZONE:-}                # a zone with quota for TPU_TYPE, e.g. us-east5-a (required)
export TPU_TYPE=${TPU_TYPE:-v5p-128}         # accelerator type; v5p-128 = v5p:4x4x4, 64 chips, 16 workers
export TPU_NAME=${TPU_NAME:-jaxrl4llm-pod}   # name of the slice
export TPU_RUNTIME=${TPU_RUNTIME:-}          # runtime image; empty: chosen from TPU_TYPE's generation
export TPU_PYTHON=${TPU_PYTHON:-3.11}        # Python of the venv on every worker (uv downloads it)
export JAXRL4LLM_REPO=${JAXRL4LLM_REPO:-https://github.com/your-org/jaxrl4llm.git}
export JAXRL4LLM_REF=${JAXRL4LLM_REF:-main}  # branch, tag or commit checked out on every worker
export BUCKET=${BUCKET:-}                    # bucket name (no gs://) mounted on every worker; empty: no mount
export MOUNT=${MOUNT:-/mnt/bucket}           # where BUCKET is mounted
export RUN_LOG=${RUN_LOG:-jaxrl4llm-run.log} # each worker's training log, in its home directory
export MAX_RESTARTS=${MAX_RESTARTS:-5}       # relaunches after a preemption or a crash (tpu_scripts/supervise.sh)
