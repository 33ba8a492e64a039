"""One process of a (simulated) multi-host run: `train` on CPU devices, joined by jax.distributed.

    python -m tests.train.multihost_main SPEC_JSON

SPEC_JSON: {"process_id", "num_processes", "port", "devices" (per process), "assets" (the
demo_assets paths), "out_dir", "steps", "resume", "result" (where process 0 writes the
history and final parameters), "hold" (seconds to sleep after each step: the kill and SIGTERM
tests; each step's line then carries its record's numbers), "light" (the fault tests' cheaper run: LIGHT), "compile_cache" (trainer.compile_cache; default off), "watch" (run under preemption.watch, as `jaxrl4llm train` does: a SIGTERM'd run writes
{"preempted": step} to the result and exits 75), "staleness" (trainer.max_staleness, default 0), "partial" (rollout.partial, default false)}.
"""

import json
import os
import sys

from tests.subprocess_xla_flags import xla_flags  # imports no JAX

spec = json.loads(sys.argv[1])
os.environ["XLA_FLAGS"] = xla_flags(spec["devices"])
os.environ["JAX_PLATFORMS"] = "cpu"
if spec["num_processes"] > 1:
    os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{spec['port']}", JAX_NUM_PROCESSES=str(spec["num_processes"]),
                      JAX_PROCESS_ID=str(spec["process_id"]), JAXRL4LLM_HEARTBEAT_SECONDS="10")

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.train import hosts  # noqa: E402

if spec["num_processes"] > 1:
    hosts.initialize()

from jaxrl4llm.train import loop  # noqa: E402
from jaxrl4llm.train.config import load_config  # noqa: E402
from tests.train.conftest import tiny_overrides  # noqa: E402


# the fault tests (spec "light"): what they show needs two processes and checkpoints, not the
# update's structure: one mini-batch of padded rows, the sampler on the training mesh, no
# evaluation or export (fewer and smaller programs to compile: the run is up sooner)
LIGHT = {"trainer.mini_batches": 1, "trainer.micro_batch_size": "null", "rollout.tensor_parallel": 0,
         "trainer.eval_every": -1, "trainer.export_hf": False, "trainer.packing": False}

# partial rollouts (spec "partial"): fewer slots than rows and short bursts, so rows cross segments;
# the sampler 2-way tensor parallel (also in a light run: its 4 prompts split over 4 data-parallel shards)
PARTIAL = {"rollout.partial": True, "rollout.slots": 8, "rollout.decode_burst": 2, "rollout.tensor_parallel": 2}


def overrides() -> list[str]:
    return tiny_overrides(spec["assets"], spec["out_dir"], **{
        "model.num_heads": 2, "model.num_kv_heads": 2, "rollout.prompts_per_step": 4, "trainer.mini_batches": 2,
        "trainer.micro_batch_size": 8, "mesh.data": 2, "mesh.fsdp": 4, "mesh.tensor": 1,
        "rollout.tensor_parallel": 2, "trainer.steps": spec["steps"], "trainer.checkpoint_every": 2,
        "trainer.eval_every": 2, "trainer.export_hf": True, "trainer.compile_cache": spec.get("compile_cache", "off"),
        "trainer.max_staleness": spec.get("staleness", 0), **(LIGHT if spec.get("light") else {}),
        **(PARTIAL if spec.get("partial") else {})})


def main() -> int:
    assert jax.device_count() == 8 and jax.process_count() == spec["num_processes"], jax.devices()
    if spec.get("hold"):  # the kill test: slow steps, so a peer can be killed mid-run
        original = loop.step_record

        def slow(*args, **kwargs):
            record = original(*args, **kwargs)
            numbers = {k: float(v) for k, v in record.items() if isinstance(v, (int, float, np.number))}
            print(f"step {args[-1] + 1} done {json.dumps(numbers)}", flush=True)  # a relaunch's step compared
            time.sleep(spec["hold"])
            return record
        loop.step_record = slow
    if spec.get("watch"):
        from jaxrl4llm.train import preemption

        with preemption.watch():
            try:
                loop.train(load_config(None, overrides()), resume=spec["resume"], log=lambda s: None)
            except preemption.Preempted as p:
                with open(f"{spec['result']}_{jax.process_index()}.json", "w") as f:
                    json.dump({"preempted": p.step}, f)
                return preemption.RESUME_EXIT_CODE
        return 0
    summary = loop.train(load_config(None, overrides()), resume=spec["resume"], log=lambda s: None)
    params = jax.tree.map(hosts.fetch, summary["state"].params)  # every process takes part in the gather
    if hosts.is_main():
        leaves = {str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))}
        np.savez(spec["result"] + ".npz", **leaves)
        with open(spec["result"] + ".json", "w") as f:
            json.dump({"history": summary["history"], "eval_after": summary["eval_after"]}, f)
    print("OK", jax.process_index(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
