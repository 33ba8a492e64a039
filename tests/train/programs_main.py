"""Run in a subprocess with 8 simulated CPU devices (tests/train/test_programs.py): for a sample of
meshes and row forms, the StableHLO `plan` lowers for the update and the log-prob pass equals the
loop's programs lowered on the same arguments (metadata stripped): plan_run's trainer stage
(`plan_inputs` -> `plan_trainer`), the sampler's programs left out (they are not the update's).

    python -m tests.train.programs_main ASSETS_JSON OUT_DIR

Prints "OK <n> programs" or the first program that differs.
"""

import json
import os
import sys

from tests.subprocess_xla_flags import xla_flags  # imports no JAX

os.environ["XLA_FLAGS"] = xla_flags(8)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

from jaxrl4llm.plan.programs import plan_inputs, plan_trainer  # noqa: E402
from jaxrl4llm.train.loop import run_meshes, setup_run  # noqa: E402
from tests.train.test_programs import demo_config, hlo_text  # noqa: E402

# configs/demo.yaml (cosine schedule, warm-up, a custom loss) on 8 devices: 16 rows a step
SAMPLE = {
    "fsdp 8, packed rows": {"mesh.data": 1, "mesh.fsdp": 8, "trainer.packing": True},
    "data 2 x fsdp 4, LoRA, padded rows": {"mesh.data": 2, "mesh.fsdp": 4, "trainer.packing": False,
                                           "model.lora.rank": 4},
}


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    assets, out = json.loads(sys.argv[1]), sys.argv[2]
    count = 0
    for name, extra in SAMPLE.items():
        extra = {"rollout.prompts_per_step": 4, "trainer.micro_batch_size": 8, **extra}
        cfg = demo_config(assets, out, **extra)
        mesh, _ = run_meshes(cfg)
        run, _ = setup_run(cfg, mesh, lambda line: None)
        # plan's trainer programs (plan_run's plan_trainer stage; the sampler's are not the loop's update)
        ins = plan_inputs(demo_config(assets, out, **extra, **{"model.vocab_size": run.policy.config.vocab_size}), "cpu")
        if run.settings != ins.layout.update:
            print(f"LAYOUT {name}: {run.settings} != {ins.layout.update}")
            return 1
        planned = {p.name: p.lowered for p in plan_trainer(ins)[0]}
        for program_name, program in (("update", run.programs.update), ("logprob pass", run.programs.logprob_pass)):
            args, kwargs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), planned[program_name].args_info)
            with jax.set_mesh(mesh):
                loop = program.lower(*args, **kwargs)
            if hlo_text(loop) != hlo_text(planned[program_name]):
                print(f"DIFFERS {name}: plan's {program_name} is not the loop's")
                return 1
            count += 1
        print(f"{name}: the update and the log-prob pass equal", flush=True)
    print(f"OK {count} programs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
