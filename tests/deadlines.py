"""The one deadline helper of the tests: poll until a condition holds, or fail naming it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_until(predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `predicate` until truthy; fail the test naming `what` (and the last value) at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as exc:  # the object may not exist yet
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
