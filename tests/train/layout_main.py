"""Run in a subprocess with 8 simulated CPU devices: for every shipped model config, alone and under
each shipped recipe and ablation, with LoRA and with a sampler on devices of its own, the layout the
loop resolves on the 8 devices (`loop.run_meshes`, `policy.random_model_config`, `layout.run_layout`)
equals the one `plan` resolves for an 8-chip TPU topology (`plan.programs.plan_layout`), compared
as one object but for the attention kernels, which follow the platform (`kernels.choice`: XLA's on
the CPU devices, splash for training on the TPU chips); a combination one refuses (a ConfigError, e.g.
router replay on a dense model), the other refuses with the same message. Prints "OK <n> layouts" or
the first mismatch's fields."""

import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402

import jax  # noqa: E402

from jaxrl4llm.data import build_char_tokenizer  # noqa: E402
from jaxrl4llm.models import load_tokenizer  # noqa: E402
from jaxrl4llm.plan.programs import plan_layout  # noqa: E402
from jaxrl4llm.sampling.buckets import PROMPT_BUCKETS, bucket  # noqa: E402
from jaxrl4llm.train.config import ConfigError, load_config  # noqa: E402
from jaxrl4llm.train.layout import run_layout  # noqa: E402
from jaxrl4llm.train.loop import run_meshes  # noqa: E402
from jaxrl4llm.train.policy import random_model_config  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TOPOLOGY = "v5p:2x2x2"  # 8 chips (2 hosts of 4), the shape of the 8 simulated devices
EIGHT_CHIPS = ["mesh.data=-1", "mesh.fsdp=8", "mesh.tensor=1"]  # the shipped meshes (64 chips, fsdp 8-16) on 8
VARIANTS = {
    "as shipped": [],
    "lora": ["model.lora.rank=16", "model.lora.dropout=0.05"],
    "own sampler": ["mesh.sampler_devices=0.5", "trainer.max_staleness=1", "mesh.data=1", "mesh.fsdp=-1"],
    "tensor-parallel sampler": ["rollout.tensor_parallel=2"],
    "padded rows": ["trainer.packing=false", "trainer.share_prompt=auto"],
    "row form chosen": ["trainer.packing=auto"],
    "single step": ["trainer.mini_batches=1", "trainer.micro_batch_size=128"],
}


def loop_layout(cfg, tokenizer):
    """What `loop.setup_run` resolves: its meshes, the random model `load_policy` builds, the data's
    longest prompt (here the bucket of data.max_prompt_tokens: plan's assumption)."""
    mesh, sampler_mesh = run_meshes(cfg)
    return run_layout(cfg, mesh, random_model_config(cfg, tokenizer),
                      prompt_width=bucket(cfg.data.max_prompt_tokens, PROMPT_BUCKETS), sampler_mesh=sampler_mesh)


def resolved(layout):
    """(layout(), None), or (None, the message) where it raises a ConfigError."""
    try:
        return layout(), None
    except ConfigError as e:
        return None, str(e)


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    tokenizer = load_tokenizer(build_char_tokenizer(Path(tempfile.mkdtemp()) / "tokenizer"))
    recipes = [None, *sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "demo.yaml"),
               *sorted((CONFIGS / "ablations").glob("*.yaml"))]
    count = refused = 0
    for model in sorted((CONFIGS / "models").glob("*.yaml")):
        for recipe in recipes:
            for name, overrides in VARIANTS.items():
                files = [model] + ([recipe] if recipe else [])
                cfg = load_config(files, EIGHT_CHIPS + overrides)
                cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tokenizer="unused"))
                (ours, our_error), (plans, plan_error) = (resolved(lambda: loop_layout(cfg, tokenizer)),
                                                          resolved(lambda: plan_layout(cfg, TOPOLOGY)))
                if our_error or plan_error:  # e.g. router replay (lite_ppo_r3) on a dense model: both refuse, alike
                    if our_error != plan_error:
                        print(f"REFUSAL {[f.name for f in files]} {name}: loop {our_error!r}, plan {plan_error!r}")
                        return 1
                    refused += 1
                    continue
                # the kernels follow the platform (kernels.choice): CPU devices here, TPU chips in plan
                if (ours.decode_attention.kernel, ours.train_attention.kernel) != ("xla", "xla") or \
                        plans.train_attention.kernel != "splash":
                    print(f"KERNELS {[f.name for f in files]} {name}: {ours.decode_attention} {ours.train_attention} "
                          f"{plans.train_attention}")
                    return 1
                if (ours.experts is None) != (plans.experts is None) or ours.experts and (
                        ours.experts["train"].kernel != "dense_capacity" or plans.experts["train"].kernel != "ragged_dot"
                        or plans.experts["weight_grad"].kernel != "tgmm"):
                    print(f"EXPERTS {[f.name for f in files]} {name}: {ours.experts} {plans.experts}")
                    return 1
                ours, plans = (dataclasses.replace(x, decode_attention=None, train_attention=None, experts=None)
                               for x in (ours, plans))
                if ours != plans:
                    a, b = ours.to_dict(), plans.to_dict()
                    diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
                    print(f"MISMATCH {[f.name for f in files]} {name}: {diff}")
                    return 1
                count += 1
    print(f"OK {count} layouts ({refused} combinations refused alike by the loop and plan)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
