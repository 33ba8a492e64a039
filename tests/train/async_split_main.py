"""Run in a subprocess with 8 simulated CPU devices: asynchronous RL (trainer.max_staleness=1) with
the sampler on 4 devices of its own and the update on the other 4 gives the run of k=1 on 8
shared devices (the same rollouts and rewards; parameters to float32 rounding of the meshes)."""

import os
import sys
import tempfile
from pathlib import Path

from tests.subprocess_xla_flags import xla_flags  # imports no JAX

os.environ["XLA_FLAGS"] = xla_flags(8, os.environ.get("XLA_FLAGS", ""))
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.data import build_char_tokenizer, write_demo_task  # noqa: E402
from jaxrl4llm.train.config import load_config  # noqa: E402
from jaxrl4llm.train.loop import run_meshes, train  # noqa: E402
from tests.train.conftest import tiny_overrides  # noqa: E402


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    root = Path(tempfile.mkdtemp())
    paths = write_demo_task(root / "data", num_train=64, num_test=8, seed=0, digits=1, ops="+", steps=1)
    assets = {"train": paths["train"], "test": paths["test"], "tokenizer": build_char_tokenizer(root / "tok")}
    common = {"trainer.steps": 3, "trainer.max_staleness": 1, "rollout.engine": "static", "trainer.eval_every": 0,
              "data.eval_limit": 4}  # held-out accuracy sampled on the sampler's devices too
    split = load_config(None, tiny_overrides(assets, root / "split", **common, **{"mesh.sampler_devices": 4}))
    shared = load_config(None, tiny_overrides(assets, root / "shared", **common))

    mesh, sampler = run_meshes(split)
    devices = jax.devices()
    assert list(sampler.devices.flat) == devices[:4] and list(mesh.devices.flat) == devices[4:], (sampler, mesh)
    a = train(split, log=lambda s: None)
    b = train(shared, log=lambda s: None)
    for x, y in zip(a["history"], b["history"]):
        for key in ("reward", "response_length", "staleness_mean"):
            assert x[key] == y[key], (key, x[key], y[key])
        np.testing.assert_allclose(x["loss"], y["loss"], rtol=1e-5, atol=1e-7)
    assert a["eval_after"] == b["eval_after"] and a["eval_before"] == b["eval_before"], (a["eval_after"], b["eval_after"])
    for x, y in zip(jax.tree.leaves(a["state"].params), jax.tree.leaves(b["state"].params)):
        assert {d.id for d in x.sharding.device_set} == {d.id for d in devices[4:]}
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    print("OK async split")
    return 0


if __name__ == "__main__":
    sys.exit(main())
