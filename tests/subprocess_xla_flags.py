"""XLA_FLAGS of the test subprocesses that compile programs of their own: the runs on simulated CPU
devices (tests/*/..._main.py) and the GPU check's dry run (tests/test_gpu_check.py).

Each such process starts with no compiled program (the session's persistent cache, tests/conftest.py,
is the pytest worker's) and runs them a few steps on a tiny model: compiling is most of its time.
At --xla_backend_optimization_level=0 XLA's CPU backend skips LLVM's optimisation passes, which
takes a fifth to a quarter off such a process (tests/train/sharded_step_main.py, twice each way on
the shared 2-core VM at load 7-9: 178 s -> 133 s, 253 s -> 205 s). Each of these tests compares runs
made under the same flags (8 devices against 1, two processes against one, a split sampler against
a shared one) or checks that figures are reported, never a pinned figure, so the unoptimised code's
rounding cannot move an expected value. The in-process suite keeps XLA's defaults
(tests/train/test_demo.py compares the quick demo's metrics bit for bit with a pin).
"""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int, inherited: str = "") -> str:
    """`inherited` (the caller's XLA_FLAGS) + `devices` simulated CPU devices + FAST_COMPILE."""
    return f"{inherited} --xla_force_host_platform_device_count={devices} {FAST_COMPILE}".strip()
