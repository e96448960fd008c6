"""Waiting for another process's state the way tests must: poll it, bounded, never a fixed sleep."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(cond: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    """Poll `cond` until it returns something true (returned); AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def fleet_member(view: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The member `name` in a registry's fleet view (`GET /fleet`), or None."""
    return next((m for m in view["members"] if m["name"] == name), None)
