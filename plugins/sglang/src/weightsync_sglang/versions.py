"""weightsync versions are integers; SGLang's `weight_version` is a free string ("default" at
start). We write `f"{prefix}{v}"` (prefix "" by default, so version 7 is "7") and read it back
the same way; SGLang's start value "default" (or no value) is weightsync's version 0."""

from __future__ import annotations

import re

SGLANG_INITIAL = "default"


def to_sglang(version: int, prefix: str = "") -> str:
    if version < 0:
        raise ValueError(f"version {version} is negative; versions start at 0")
    return f"{prefix}{version}"


def from_sglang(value: object, prefix: str = "") -> int:
    """Parse SGLang's weight_version; raise ValueError for a string weightsync did not write."""
    if value is None or value == SGLANG_INITIAL or value == "":
        return 0
    text = str(value)
    m = re.fullmatch(re.escape(prefix) + r"(\d+)", text)
    if not m:
        raise ValueError(f"weight_version {text!r} was not written by weightsync (expected "
                         f"{prefix!r} followed by an integer, or {SGLANG_INITIAL!r}); set the "
                         f"adapter option version_prefix to match, or restart the engine")
    return int(m.group(1))
