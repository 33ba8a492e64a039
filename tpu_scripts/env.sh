# Settings for the TPU scripts; edit, then `source tpu_scripts/env.sh`.
export TPU_PROJECT=${TPU_PROJECT:-my-gcp-project}
export TPU_ZONE=${TPU_ZONE:-us-central2-b}
export TPU_TYPE=${TPU_TYPE:-v4-32}
export TPU_NAME=${TPU_NAME:-jaxrl4llm-pod}
export TPU_RUNTIME=${TPU_RUNTIME:-tpu-ubuntu2204-base}
export JAXRL4LLM_REPO=${JAXRL4LLM_REPO:-https://github.com/your-org/jaxrl4llm.git}
export JAXRL4LLM_REF=${JAXRL4LLM_REF:-main}
