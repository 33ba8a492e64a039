"""jaxrl4llm: pure-functional JAX library and trainer for RL of LLM reasoning.

Subpackages (data flows down, imports point up only):
  core      pure loss math on arrays (advantages, surrogate, aggregation, KL, filters, recipes)
  models    Flax LLMs (Qwen2/2.5, Qwen3, Llama 3) with HF safetensors load/export
  sampling  JAX rollout engine (prefill + KV-cache decode, top-p/top-k, n samples per prompt)
  rewards   math answer verifier on sympy
  tools     the tools a policy calls mid-rollout (a confined Python executor)
  data      dataset loaders, prompt templates, difficulty binning, demo task
  train     sharded train step, RL loop, checkpoints, metrics
"""

__version__ = "0.1.0"
