"""Flax NNX LLMs (Qwen2/2.5, Qwen3, Llama 3, Qwen3-MoE) with Hugging Face checkpoint I/O and LoRA.

    graphdef, state = load_pretrained(path)              # or init_model(config, rng), nnx.split(model)
    logits = forward(graphdef, state, tokens, positions=..., attention_mask=...)

The module tree is `CausalLM` (docs/models.md); every jitted program takes the `state` pytree
with `graphdef` static and rebuilds the module inside with `nnx.merge`.
"""

from jaxrl4llm.models.config import SUPPORTED_ARCHITECTURES
from jaxrl4llm.models.config import ConfigError
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.causal_lm import CausalLM
from jaxrl4llm.models.causal_lm import LlamaForCausalLM
from jaxrl4llm.models.causal_lm import Qwen2ForCausalLM
from jaxrl4llm.models.causal_lm import Qwen3ForCausalLM
from jaxrl4llm.models.causal_lm import Qwen3MoeForCausalLM
from jaxrl4llm.models.causal_lm import abstract_model
from jaxrl4llm.models.causal_lm import forward
from jaxrl4llm.models.causal_lm import hidden_states
from jaxrl4llm.models.causal_lm import init_model
from jaxrl4llm.models.causal_lm import merge
from jaxrl4llm.models.causal_lm import model_class
from jaxrl4llm.models.causal_lm import positions_from_mask
from jaxrl4llm.models.causal_lm import score_tokens
from jaxrl4llm.models.causal_lm import score_tokens_with_routes
from jaxrl4llm.models.layers.linear import LORA_TARGETS
from jaxrl4llm.models.layers.linear import LoraSettings
from jaxrl4llm.models.lora import add_lora
from jaxrl4llm.models.lora import merge_lora
from jaxrl4llm.models.lora import split_trainable
from jaxrl4llm.models.sharding import DEFAULT_RULES
from jaxrl4llm.models.sharding import batch_sharding
from jaxrl4llm.models.sharding import logical_axes
from jaxrl4llm.models.sharding import logical_to_spec
from jaxrl4llm.models.sharding import make_mesh
from jaxrl4llm.models.sharding import param_shardings
from jaxrl4llm.models.checkpoint import CheckpointError
from jaxrl4llm.models.checkpoint import load_pretrained
from jaxrl4llm.models.checkpoint import save_pretrained
from jaxrl4llm.models.tokenizer import load_tokenizer
