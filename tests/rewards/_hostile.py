"""Functions the sandbox tests run inside worker processes (must be importable by name)."""

import time


def sleep_then_return(seconds: float, value):
    time.sleep(seconds)
    return value


def spin_forever():
    while True:
        pass


def big_int_forever():
    x = 7
    while True:
        x = x * x  # grows until the memory cap or the deadline stops it


def crash():
    import os

    os._exit(3)


def pid(_=None):
    import os

    return os.getpid()


def fail():
    raise ValueError("boom")


def ignore_alarm_and_spin():
    """Ignore the worker's soft alarm, so only the caller's hard kill can stop this."""
    import signal

    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    while True:
        pass


def huge_power():
    return pow(7, 10**10)  # one C call: signals are not handled until it returns
