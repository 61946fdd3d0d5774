"""Waiting on a condition with a bound (the tests sleep for no fixed time)."""

from __future__ import annotations

import time


def wait_until(cond, timeout_s: float = 15.0, what: str = "condition", poll_s: float = 0.02):
    """`cond()`'s first truthy value; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(poll_s)
