"""What the trainer and its relaying members agree on: the xxh3 digest of every `piece_bytes`
slice of a payload body (announced to each member over its own channel before the bytes arrive),
and the acknowledgement a member signs with a key only it and the trainer hold."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Mapping

import torch

from weightsync.errors import PayloadError
from weightsync.wire.digests import digest_at

PIECE_HEADER = b"weightsync-piece"


class Tampered(PayloadError):
    """A piece that does not match the digest the trainer announced."""


def piece_digest(address: int, nbytes: int) -> str:
    """xxh3-128 of `nbytes` of memory at `address` (one piece)."""
    return digest_at(PIECE_HEADER, address, nbytes)


def piece_digests(body: torch.Tensor, piece_bytes: int) -> list[str]:
    """The digest of each `piece_bytes` slice of a CPU uint8 payload body, in order."""
    n = body.numel()
    base = body.data_ptr()
    return [piece_digest(base + a, min(piece_bytes, n - a)) for a in range(0, n, piece_bytes)] \
        if n else []


def ack(key: str, index: int, status: str, detail: str = "") -> str:
    """A member's signed answer for bucket `index`: status "ok" (detail: the digest it staged)
    or "tampered" (detail: the parent that sent bytes not matching the announced digests)."""
    msg = json.dumps([int(index), status, detail], separators=(",", ":")).encode()
    return hmac.new(key.encode(), msg, hashlib.sha256).hexdigest()


def entry(key: str, index: int, status: str, detail: str = "", error: str = "") -> dict[str, Any]:
    """One member's signed answer for the trainer."""
    return ({"status": status, "detail": detail, "mac": ack(key, index, status, detail)}
            | ({"error": error} if error else {}))


def checked(key: str, index: int, got: Any) -> tuple[str, str] | None:
    """(status, detail) of an answer with a valid signature, else None (the trainer feeds it)."""
    if not isinstance(got, Mapping):
        return None
    status, detail, mac = got.get("status"), got.get("detail", ""), got.get("mac")
    if not (isinstance(status, str) and isinstance(detail, str) and isinstance(mac, str)
            and hmac.compare_digest(mac, ack(key, index, status, detail))):
        return None
    return status, detail
