"""The decode backends agree: the platform-neutral layout (separate q/k/v, stacked gate/up: what
TPU/GPU run) and the CPU one (fused projections, 16-bit moves as bits) give the same rollout."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl4llm.models.decode import DecodeBackend
from jaxrl4llm.sampling.buckets import left_pad_prompts
from jaxrl4llm.sampling.decode_backends import CpuBackend
from jaxrl4llm.sampling.decode_loop import sample_program, weights_program
from tests.sampling.conftest import PAD, load_family, random_prompts


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # q/k/v biases; q/k norms and an untied head
def test_neutral_and_cpu_layouts_sample_the_same_rows(family, tmp_path_factory):
    _, config, graphdef, state = load_family(family, tmp_path_factory)
    padded = left_pad_prompts(random_prompts(2), pad_token_id=PAD, length=16, num_rows=4)
    rows = {}
    for backend in (DecodeBackend(), CpuBackend()):
        weights = weights_program(graphdef, state, config=config, backend=backend)
        assert ("qkv_t" in weights["layers"][0]) == backend.fused_projections
        out = sample_program(weights, padded.tokens, padded.mask, padded.row_valid, jax.random.key(3), np.int32(0),
                             np.float32(1.0), np.float32(1.0), np.asarray([-1], np.int32), np.int32(PAD),
                             config=config, num_samples=2, max_new_tokens=12, top_k=0, use_top_p=False,
                             greedy=False, block_size=8, backend=backend)
        rows[type(backend).__name__] = out
    a, b = rows["DecodeBackend"], rows["CpuBackend"]
    np.testing.assert_array_equal(a.response_tokens, b.response_tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert dataclasses.is_dataclass(CpuBackend()) and hash(DecodeBackend()) != hash(CpuBackend())
