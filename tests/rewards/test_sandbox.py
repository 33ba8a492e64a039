"""The sandbox pool: hard time limits, worker reuse and replacement, ordering, threads."""

import threading
import time

import pytest

from jaxrl4llm.rewards import SandboxPool, batch_math_reward, math_equal, math_reward
from tests.rewards import _hostile

HOSTILE_RESPONSES = {
    "power tower": r"The answer is $\boxed{10^{10^{10^{10}}}}$",
    "power tower vs equal tower": r"\boxed{9^{9^{9^{9}}}}",
    "huge factorial": r"\boxed{(10^{10})!}",
    "1 MB response": "x" * 1_000_000 + r" \boxed{5}",
    "10,000 nested braces": "\\boxed{" + "{" * 10_000 + "5" + "}" * 10_000 + "}",
    "10,000 nested parens": r"\boxed{" + "(" * 10_000 + "5" + ")" * 10_000 + "}",
    "long answer": r"\boxed{" + "+".join(["x"] * 5000) + "}",
    "huge exponent": r"\boxed{2^{1000000000}}",
    "huge number": r"\boxed{1" + "0" * 5000 + "}",
    "huge scientific": r"\boxed{1e999999999}",
    "deep fraction": r"\boxed{" + r"\frac{1}{" * 300 + "2" + "}" * 300 + "}",
    "big polynomial": r"\boxed{(x+1)^{5000} - (x-1)^{5000}}",
    # These pass every size guard and only the time limit stops them:
    "product of a million terms": r"\boxed{\prod_{k=1}^{1000000} k}",
    "long numeric sum": r"\boxed{\sum_{k=1}^{100000} \sin(k)}",
}


@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    """Start the shared workers first: start-up time is not part of any call's limit."""
    math_reward(r"\boxed{\sqrt{4}}", "2")


@pytest.mark.parametrize("name", sorted(HOSTILE_RESPONSES))
def test_hostile_inputs_score_zero_within_the_limit(name):
    timeout = 2.0
    start = time.monotonic()
    reward = math_reward(HOSTILE_RESPONSES[name], "5", timeout=timeout)
    elapsed = time.monotonic() - start
    assert reward == 0.0
    assert elapsed < timeout + 1.0, f"{name} took {elapsed:.2f}s"


def test_hostile_batch_keeps_order_and_limit():
    names = sorted(HOSTILE_RESPONSES)
    responses = [HOSTILE_RESPONSES[n] for n in names] + [r"\boxed{5}"]
    start = time.monotonic()
    rewards = batch_math_reward(responses, ["5"] * len(responses), timeout=2.0)
    assert rewards == [0.0] * len(names) + [1.0]
    assert time.monotonic() - start < 2.0 * len(names) / 2 + 3.0


def test_pool_kills_a_stuck_worker_and_replaces_it():
    with SandboxPool(2) as pool:
        pids_before = set(pool.run(_hostile.pid, [(i,) for i in range(4)], timeout=30))
        start = time.monotonic()
        out = pool.run(_hostile.spin_forever, [()], timeout=0.5, default="timed out")
        assert out == ["timed out"]
        assert time.monotonic() - start < 2.0
        # Well-behaved Python code stops on the in-worker alarm: the worker survives.
        out = pool.run(_hostile.sleep_then_return, [(10, "late")], timeout=0.5, default="timed out")
        assert out == ["timed out"]
        # Work that ignores the alarm (or is stuck in one C call) is killed and replaced.
        start = time.monotonic()
        out = pool.run(_hostile.ignore_alarm_and_spin, [()], timeout=1.0, default="timed out")
        assert out == ["timed out"] and time.monotonic() - start < 2.5
        out = pool.run(_hostile.huge_power, [()], timeout=1.0, default="timed out")
        assert out == ["timed out"] and time.monotonic() - start < 5.0
        out = pool.run(_hostile.big_int_forever, [()], timeout=1.0, default="timed out")
        assert out == ["timed out"]
        assert pool.run(_hostile.sleep_then_return, [(0, "alive")], timeout=30) == ["alive"]
        assert pool.restarts >= 1
        assert len(pids_before) <= 2


def test_pool_reuses_workers():
    with SandboxPool(2) as pool:
        pids = set()
        for _ in range(3):
            pids |= set(pool.run(_hostile.pid, [(i,) for i in range(20)], timeout=30))
        assert len(pids) <= 2  # 60 calls, never more than the two original processes
        assert pool.restarts == 0


def test_pool_results_are_in_input_order_and_parallel():
    with SandboxPool(2) as pool:
        pool.run(_hostile.pid, [(0,), (1,)], timeout=30)  # wait until both workers are up
        delays = [0.3, 0.0, 0.2, 0.0, 0.1, 0.0]
        start = time.monotonic()
        out = pool.run(_hostile.sleep_then_return, [(d, i) for i, d in enumerate(delays)], timeout=10)
        assert out == list(range(len(delays)))
        assert time.monotonic() - start < sum(delays) + 0.25  # two workers overlap the sleeps


def test_pool_survives_crashes_and_exceptions():
    with SandboxPool(1) as pool:
        assert pool.run(_hostile.crash, [()], timeout=10, default="crashed") == ["crashed"]
        assert pool.run(_hostile.fail, [()], timeout=10, default="failed") == ["failed"]
        assert pool.run(_hostile.sleep_then_return, [(0, 7)], timeout=10) == [7]


def test_time_limit_works_outside_the_main_thread():
    results = {}

    def target():
        start = time.monotonic()
        results["reward"] = math_reward(r"\boxed{10^{10^{10^{10}}}}", "5", timeout=1.0)
        with SandboxPool(1) as pool:
            results["spin"] = pool.run(_hostile.spin_forever, [()], timeout=0.5, default=None)
        results["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    assert results["reward"] == 0.0 and results["spin"] == [None]
    assert results["elapsed"] < 20


def test_batch_results_are_in_input_order():
    golds = [str(i) for i in range(60)]
    responses = [rf"so \boxed{{\frac{{{2 * i}}}{{2}}}}" if i % 3 else rf"\boxed{{{i + 1}}}" for i in range(60)]
    expected = [1.0 if i % 3 else 0.0 for i in range(60)]
    assert batch_math_reward(responses, golds) == expected


def test_batch_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one gold answer per response"):
        batch_math_reward(["1", "2"], ["1"])


def test_bad_timeout_is_rejected():
    with pytest.raises(ValueError, match="timeout"):
        math_equal("1", "1", timeout=0)


def test_num_workers_is_respected():
    assert batch_math_reward([r"\boxed{\sqrt{4}}"] * 4, ["2"] * 4, num_workers=1) == [1.0] * 4
