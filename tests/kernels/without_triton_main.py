"""A jax without Pallas' Triton backend (simulated: importing `jax.experimental.pallas.triton` fails):
jaxrl4llm imports, the layout picks XLA's attention on GPUs and says why, a forced Triton kernel is a
ValueError naming the fix, and the sampler and the trainer run (on this CPU). Run by
tests/kernels/test_choice.py in a process of its own."""

import importlib.abc
import sys


class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "jax.experimental.pallas.triton" or name.startswith("jax._src.pallas.triton"):
            raise ImportError(f"No module named {name!r} (simulated)")
        return None


sys.meta_path.insert(0, NoTriton())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxrl4llm.sampling  # noqa: E402, F401
import jaxrl4llm.train.loop  # noqa: E402, F401
from jaxrl4llm.kernels import choice  # noqa: E402
from jaxrl4llm.models import ModelConfig, init_model  # noqa: E402
from jaxrl4llm.sampling.generate import generate  # noqa: E402
from jaxrl4llm.train.step import UpdateSettings, init_train_state, make_optimizer, make_update_fn  # noqa: E402


class FakeGpu:
    platform, device_kind, id = "gpu", "NVIDIA H100 80GB HBM3", 0


def main() -> int:
    assert choice.pallas_triton is None
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, dtype="bfloat16")
    decode = choice.decode_attention_choice(config, [FakeGpu()], cpu_kernels=False, page_size=16)
    assert decode.kernel == "xla" and decode.fallback and "no Pallas Triton backend" in decode.reason, decode
    train = choice.train_attention_choice("auto", "gpu")
    assert train.kernel == "xla" and train.fallback and "pip install -e .[cuda]" in train.reason, train
    for call in (lambda: choice.train_attention_choice("pallas_gpu", "gpu"),
                 lambda: choice.decode_attention_choice(config, [FakeGpu()], cpu_kernels=False, page_size=16,
                                                        requested="kernel")):
        try:
            call()
        except ValueError as e:
            assert "no Pallas Triton backend" in str(e), e
        else:
            raise AssertionError("a Triton kernel was granted without the backend")
    # the sampler and the trainer on this CPU (XLA's paths)
    graphdef, params = init_model(config.replace(dtype="float32"), jax.random.PRNGKey(0))
    rollout = generate(graphdef, params, [[1, 2, 3], [4, 5]], num_samples=2, max_new_tokens=4, eos_token_ids=[0],
                       pad_token_id=0, rng=jax.random.PRNGKey(1))
    assert rollout.response_tokens.shape[0] == 4
    from tests.train.toy_model import toy_batch, toy_logprob_fn, toy_params
    from jaxrl4llm.core import LITE_PPO

    opt, sched = make_optimizer(lr=1e-2, max_grad_norm=None)
    update = make_update_fn(logprob_fn=toy_logprob_fn, recipe=LITE_PPO, optimizer=opt, schedule=sched,
                            settings=UpdateSettings(micro_batches=2))
    state, metrics, _ = jax.jit(update)(init_train_state(toy_params(), opt), toy_batch())
    assert int(state.step) == 1 and bool(jnp.isfinite(metrics["loss"]))
    print("OK without Pallas' Triton backend")
    return 0


if __name__ == "__main__":
    sys.exit(main())
