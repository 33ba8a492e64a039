import pytest

from jaxrl4llm.plan.programs import plan_run
from jaxrl4llm.train.config import load_config

TINY = ["model.vocab_size=64", "model.hidden_size=128", "model.intermediate_size=256", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=32", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=64", "data.max_prompt_tokens=32",
        "trainer.mini_batches=2", "trainer.micro_batch_size=4", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1",
        "rollout.engine=static",  # the static sampler's plan; tests/plan/test_continuous_plan.py plans the continuous one
        "trainer.packing=true"]  # packed rows (the default `auto` takes shared-prompt rows at these short lengths)


@pytest.fixture(scope="session")
def plan():
    """The tiny run compiled for v5e:2x2 (4 chips, FSDP), at the default length distribution."""
    return plan_run(load_config(None, TINY), "v5e:2x2")
