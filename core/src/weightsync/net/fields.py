"""Numbers in requests, checked before anything reads them: a weight route's version is a JSON
integer in range, never a float, a bool or a number too large for an engine to store."""

from __future__ import annotations

from typing import Any

from weightsync.net.server import HttpError

__all__ = ["MAX_VERSION", "json_int"]

MAX_VERSION = 2**63 - 1   # the largest weight version any route takes (every engine stores it)


def json_int(value: Any, field: str, lo: int = 0, hi: int = MAX_VERSION) -> int:
    """`value` from a JSON body (or a query string) as an integer in [lo, hi]: 1e400, 2.5, true,
    "7x" or 2**64 are a 400 naming the field."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"{field} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise HttpError(400, f"{field} {value} is outside {lo}..{hi}")
    return value
