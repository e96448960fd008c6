"""The member half of the `http` transport's fetch relays (the trainer's is
`weightsync.transports.http.fetch`). A member fetches a bucket from the member above it (the root:
from the trainer), checks every piece against the trainer's digests before it keeps it, and offers
checked pieces on its own body server to its children while later pieces still arrive. A parent
that dies, stalls or sends a bad piece: the member fetches the rest from the trainer (through a
reference only it holds) and says why; its children keep reading from it all the while."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.net.bodyserver import REASON_HEADER, BodyServer, Live, fetch
from weightsync.errors import PayloadError, TransportError
from weightsync.transports.http.pieces import Tampered, piece_digest
from weightsync.receive.staging import read_exact

__all__ = ["FetchSpec", "Pulled", "Tampered", "fetch_body"]

log = logging.getLogger("weightsync.transports.http.member_fetch")


@dataclass
class FetchSpec:
    """What the trainer tells a member about one bucket (`fetch["relay"]`)."""
    pieces: list[str]                     # xxh3 digest of every piece of the body, in order
    piece_bytes: int
    stall: float                          # seconds without a byte before the parent is dropped
    parent: str                           # the name of the member above ("the trainer": root)
    serve: dict[str, Any] | None = None   # {"id", "token", "fetches"}: offer the body on
    fallback: dict[str, Any] | None = None  # {"url", "token", "nbytes"}: the trainer's copy

    @classmethod
    def parse(cls, fetch_ref: Mapping[str, Any]) -> FetchSpec | None:
        relay = fetch_ref.get("relay")
        if relay is None:
            return None
        try:
            spec = cls(pieces=[str(p) for p in relay["pieces"]],
                       piece_bytes=int(relay["piece_bytes"]), stall=float(relay["stall"]),
                       parent=str(relay.get("parent", "the trainer")),
                       serve=dict(relay["serve"]) if relay.get("serve") else None,
                       fallback=dict(relay["fallback"]) if relay.get("fallback") else None)
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"a relayed fetch needs pieces, piece_bytes and stall: {e}") from None
        if spec.piece_bytes < 1 or spec.stall <= 0:
            raise PayloadError("a relayed fetch needs piece_bytes >= 1 and stall > 0")
        return spec


@dataclass
class Pulled:
    """One relayed bucket as this member got it."""
    body: memoryview
    from_parent: int                      # bytes that came from the parent (the rest: trainer)
    reason: str | None = None             # why the member went to the trainer, if it did
    offered: list[str] = field(default_factory=list)   # ids offered on the body server


def fetch_body(ref: Mapping[str, Any], spec: FetchSpec, server: BodyServer | None, *, max_bytes: int,
         timeout: float) -> Pulled:
    """Fetch one bucket from `ref` (the parent's offer), offering it on `server` (None: no one)."""
    n = int(ref.get("nbytes", -1))
    if not 0 <= n <= max_bytes:
        raise PayloadError(f"a relayed body of {ref.get('nbytes')} bytes is outside this "
                           f"receiver's limit of {max_bytes}")
    if len(spec.pieces) != -(-n // spec.piece_bytes):
        raise PayloadError(f"{len(spec.pieces)} piece digests were announced for a body of {n} "
                           f"bytes in pieces of {spec.piece_bytes}")
    buf = torch.empty(max(n, 1), dtype=torch.uint8)
    # numpy's stubs give ndarray __buffer__ only on Python 3.12+
    view = memoryview(buf.numpy())[:n]  # type: ignore[arg-type]
    live = Live(view)
    out = Pulled(view, 0)
    if spec.serve is not None:
        if server is None:
            raise PayloadError("this receiver was asked to feed members but serves no bodies")
        server.offer(str(spec.serve["id"]), str(spec.serve["token"]), live,
                     int(spec.serve["fetches"]))
        out.offered.append(str(spec.serve["id"]))
    done = [0]                                # bytes checked and offered

    def consume(read_into: Callable[[memoryview], int], count: int) -> None:
        pb = spec.piece_bytes
        while done[0] < n:
            a = done[0]
            b = min(n, (a // pb + 1) * pb)
            read_exact(read_into, view[a:b])
            if piece_digest(buf.data_ptr() + a, b - a) != spec.pieces[a // pb]:
                raise Tampered(f"piece {a // pb} (bytes {a}..{b}) does not match the digest "
                               f"the trainer announced")
            done[0] = b
            live.ready(b)

    try:
        try:
            fetch(ref, consume, max_bytes=max_bytes, timeout=spec.stall)
        except (PayloadError, TransportError, OSError) as e:
            out.from_parent = done[0]
            if spec.fallback is None:
                raise
            out.reason = _why(spec.parent, e)
            log.warning("relayed bucket: %s; fetching the rest (%d of %d bytes) from the trainer",
                        out.reason, n - done[0], n)
            fetch(spec.fallback, consume, max_bytes=max_bytes, timeout=timeout,
                  offset=done[0], headers={REASON_HEADER: out.reason[:200]})
        else:
            out.from_parent = n
    except BaseException:
        live.fail()
        if server is not None:
            for bid in out.offered:
                server.withdraw_id(bid)
        raise
    return out


def _why(parent: str, e: BaseException) -> str:
    if isinstance(e, Tampered):
        return f"tampered: relay {parent} sent bytes that do not match: {e}"
    if isinstance(e, (TimeoutError, ConnectionAbortedError)) or "timed out" in str(e):
        return f"stalled: relay {parent} sent nothing for the stall time"
    return f"lost: relay {parent} could not be read: {type(e).__name__}: {e}"
