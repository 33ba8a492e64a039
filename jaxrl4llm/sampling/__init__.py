"""JAX rollout engine: prefill + KV-cache decode in one jitted while_loop, top-k/top-p, G samples per prompt;
continuous batching over slots and a paged KV cache (`continuous.py`, the default) or a static batch
(`decode_loop.py`).

    rollout = generate(graphdef, state, prompts, num_samples=G, max_new_tokens=R, temperature=0.99,
                       top_p=0.99, top_k=100, eos_token_ids=[eos], pad_token_id=pad, rng=key)

See docs/sampling.md.
"""

from jaxrl4llm.sampling.buckets import BATCH_BUCKETS
from jaxrl4llm.sampling.buckets import PROMPT_BUCKETS
from jaxrl4llm.sampling.buckets import bucket
from jaxrl4llm.sampling.buckets import left_pad_prompts
from jaxrl4llm.sampling.continuous import continuous_program
from jaxrl4llm.sampling.decode_loop import sample_program
from jaxrl4llm.sampling.decode_mesh import decode_mesh
from jaxrl4llm.sampling.filters import TokenSample
from jaxrl4llm.sampling.filters import allowed_tokens
from jaxrl4llm.sampling.filters import sample_tokens
from jaxrl4llm.sampling.filters import top_p_keep
from jaxrl4llm.sampling.generate import generate
from jaxrl4llm.sampling.generate import generate_with_tools
from jaxrl4llm.sampling.rollout import Rollout
from jaxrl4llm.sampling.rollout import decode_responses
from jaxrl4llm.sampling.rollout import group_rows
from jaxrl4llm.sampling.rollout import model_token_lists
from jaxrl4llm.sampling.rollout import model_tokens
from jaxrl4llm.sampling.rollout import prompt_token_lists
from jaxrl4llm.sampling.rollout import response_token_lists
from jaxrl4llm.sampling.tool_rollout import ToolStats
