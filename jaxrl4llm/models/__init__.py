"""Flax-free pure-JAX LLMs (Qwen2/2.5, Qwen3, Llama 3) with Hugging Face checkpoint I/O.

Parameters are a plain nested dict of arrays; every function is pure and jit-able with the
ModelConfig static. See docs/models.md.
"""

from jaxrl4llm.models.config import SUPPORTED_ARCHITECTURES
from jaxrl4llm.models.config import ConfigError
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.kv_cache import KVCache
from jaxrl4llm.models.kv_cache import init_cache
from jaxrl4llm.models.params import init_params
from jaxrl4llm.models.params import param_logical_axes
from jaxrl4llm.models.params import param_shapes
from jaxrl4llm.models.sharding import DEFAULT_RULES
from jaxrl4llm.models.sharding import batch_sharding
from jaxrl4llm.models.sharding import cache_shardings
from jaxrl4llm.models.sharding import logical_to_spec
from jaxrl4llm.models.sharding import make_mesh
from jaxrl4llm.models.sharding import param_shardings
from jaxrl4llm.models.transformer import forward
from jaxrl4llm.models.transformer import forward_with_cache
from jaxrl4llm.models.transformer import hidden_states
from jaxrl4llm.models.transformer import positions_from_mask
from jaxrl4llm.models.transformer import token_logprobs
from jaxrl4llm.models.checkpoint import CheckpointError
from jaxrl4llm.models.checkpoint import load_pretrained
from jaxrl4llm.models.checkpoint import save_pretrained
from jaxrl4llm.models.tokenizer import load_tokenizer
