"""A member that passes payloads on (the `http` transport's chain and tree shapes), engine side.

The trainer first tells each member over its own authenticated channel what bucket `index` will
be (`Desk.expect`: the digest of every piece, parent, children, answer key). The bytes then arrive
from the parent (`relay`), each piece checked against its digest before it is forwarded or kept,
so a tampered piece stops the bucket here and the signed answer names the parent. The trainer
asks every member for its outcome over the member's own channel (`Desk.answer`), never through
the tree, and feeds directly a member whose parent stalls (`Desk.supersede` stops the relay)."""

from __future__ import annotations

import hmac
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import requests

from weightsync.errors import PayloadError
from weightsync.transports.http.pieces import Tampered, entry
from weightsync.wire.frame import frame
from weightsync.transports.http.landing import Landing, Spans
from weightsync.receive.staging import read_exact

__all__ = ["RELAY_HEADER", "Desk", "Expectation", "Feed", "Tampered", "relay"]

RELAY_HEADER = "X-Weightsync-Relay"
# relayed buckets are staged on long-lived threads: a fresh server thread's allocator arena makes
# a bucket's decode several times dearer (cold pages)
_STAGER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ws-relay-stage")
_END = object()
log = logging.getLogger("weightsync.relay")


class Expectation:
    """What the trainer announced for one bucket (checked on arrival), and how its relay went."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        try:
            self.index = int(body["index"])
            self.header = dict(body["header"])
            self.nbytes = int(self.header["nbytes"])
            self.pieces = [str(p) for p in body["pieces"]]
            self.piece_bytes = int(body["piece_bytes"])
            self.name = str(body["name"])
            self.parent = str(body.get("parent") or "its parent")
            self.ack_key = str(body["ack_key"])
            self.stall = float(body.get("stall", 30.0))
            self.left = float(body.get("left", 300.0))
            self.children = [dict(c) for c in body.get("children") or []]
            for c in self.children:
                c["url"], c["name"], c["token"] = str(c["url"]), str(c["name"]), str(c["token"])
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"relay expectation is malformed ({type(e).__name__}: {e}); the "
                               f"trainer sends index, header, pieces, piece_bytes, name, ack_key")
        if self.piece_bytes <= 0 or len(self.pieces) != -(-self.nbytes // self.piece_bytes):
            raise PayloadError(f"bucket {self.index}: {len(self.pieces)} piece digests do not "
                               f"cover {self.nbytes} bytes in pieces of {self.piece_bytes}")
        self.deadline = time.monotonic() + self.left
        self.moved = time.monotonic()       # the last sign of life from the parent
        self.pieces_in = 0
        self.claimed = False                # every piece is in: the outcome is the relay's own
        self.outcome: dict[str, Any] | None = None
        self.busy = False                   # staging as it arrives: the session holds the bucket
        self.cancel: Callable[[], None] | None = None    # shuts the relay's connection

    def stalled(self) -> str:
        what = (f"after piece {self.pieces_in - 1} of {len(self.pieces)}" if self.pieces_in
                else "before its first byte")
        return (f"stalled: relay {self.parent} sent nothing of bucket {self.index} for "
                f"{self.stall:g}s ({what}); this member gave up on the relay")


class Desk:
    """A round's relay state: the relay tokens the trainer gave this member (one per sending
    rank: with `senders: all` each rank relays its own buckets), the expected buckets, and each
    one's outcome for the trainer's long poll."""

    def __init__(self) -> None:
        self.tokens: set[str] = set()
        self.expected: dict[int, Expectation] = {}
        self.cond = threading.Condition()

    def expect(self, body: Mapping[str, Any]) -> None:
        e = Expectation(body)
        token = body.get("token")
        if not isinstance(token, str) or len(token) < 16:
            raise PayloadError("relay expectation lacks a relay token of at least 16 characters")
        with self.cond:
            self.tokens.add(token)
            self.expected[e.index] = e

    def check_token(self, got: str | None) -> None:
        """Before any body byte is read: only a parent the trainer named may post."""
        with self.cond:
            tokens = list(self.tokens)
        if not isinstance(got, str) or not any(hmac.compare_digest(got, t) for t in tokens):
            raise PayloadError("relay refused: no relay token, or not the one the trainer gave "
                               "this member for this round")

    def get(self, index: Any) -> Expectation:
        with self.cond:
            e = self.expected.get(int(index)) if isinstance(index, int) else None
        if e is None:
            raise PayloadError(f"relay refused: the trainer announced no bucket {index!r} to this "
                               f"member in this round")
        return e

    def moved(self, e: Expectation, pieces_in: int) -> None:
        """The parent delivered a piece (or began its request); raises once the trainer was
        told this member gave up on the relay (it feeds the member itself)."""
        with self.cond:
            self._open(e)
            e.moved, e.pieces_in = time.monotonic(), pieces_in

    def start(self, e: Expectation, cancel: Callable[[], None] | None) -> None:
        """A relay that stages as it receives begins: until `release` the session holds the
        bucket, and `cancel` stops the relay (its connection is shut)."""
        with self.cond:
            self._open(e)
            e.moved, e.busy, e.cancel = time.monotonic(), True, cancel

    @staticmethod
    def _open(e: Expectation) -> None:
        if e.outcome is not None:
            raise PayloadError(f"bucket {e.index}: this member already answered "
                               f"({e.outcome.get('error') or e.outcome.get('status')}); "
                               f"the relayed bytes are dropped")

    def release(self, e: Expectation) -> None:
        with self.cond:
            e.busy = False
            self.cond.notify_all()

    def close(self, wait: float = 10.0) -> None:
        """The round ends: every relay still staging is stopped and lets go of its bucket."""
        with self.cond:
            busy = [e for e in self.expected.values() if e.busy]
            for e in busy:
                if e.outcome is None:
                    e.outcome = {"status": "error", "error": "the round ended"}
            self.cond.notify_all()
        for e in busy:
            if e.cancel is not None:
                e.cancel()
        with self.cond:
            self.cond.wait_for(lambda: not any(e.busy for e in busy), timeout=wait)

    def claim(self, e: Expectation) -> None:
        """Every piece is in: staging is the relay's; a stall can no longer be declared."""
        with self.cond:
            if e.outcome is not None:
                raise PayloadError(f"bucket {e.index}: this member gave up on the relay before "
                                   f"its last piece arrived; the trainer feeds it directly")
            e.claimed = True

    def record(self, e: Expectation, outcome: dict[str, Any]) -> None:
        with self.cond:
            if e.outcome is None:
                e.outcome = outcome
            self.cond.notify_all()

    def supersede(self, index: Any, wait: float = 60.0) -> None:
        """The trainer sends bucket `index` itself: a relay of it still missing pieces is dropped
        (and stopped if it stages); one that has every piece is waited for, so the two never
        stage the bucket at the same time."""
        cancel = None
        with self.cond:
            e = self.expected.get(index) if isinstance(index, int) else None
            if e is None:
                return
            if e.outcome is None and not e.claimed:
                e.outcome = {"status": "error", "error": "fed directly by the trainer"}
                self.cond.notify_all()
            if e.busy and not e.claimed:
                cancel = e.cancel
        if cancel is not None:
            cancel()
        with self.cond:
            self.cond.wait_for(lambda: e.outcome is not None and not e.busy, timeout=wait)

    def answer(self, index: Any, wait: float) -> dict[str, Any]:
        """This member's outcome for bucket `index`, once there is one, a stall, or `wait`s."""
        e = self.get(index)
        end = time.monotonic() + max(0.0, wait)
        with self.cond:
            while e.outcome is None:
                now = time.monotonic()
                if e.claimed:                       # staging: its outcome comes next
                    self.cond.wait(1.0)
                elif now - e.moved >= e.stall:
                    e.outcome = {"status": "error", "error": e.stalled()}
                elif now >= end:                    # the trainer feeds it now; the relay stops
                    e.outcome = {"status": "error", "error": f"bucket {e.index} did not come "
                                                             f"through relay {e.parent} within "
                                                             f"{wait:g}s"}
                else:
                    self.cond.wait(max(0.01, min(end - now, e.moved + e.stall - now)))
            return dict(e.outcome)


class Feed:
    """One child's frame, sent as its pieces arrive (iterable, with a Content-Length: streamed)."""

    def __init__(self, child: Mapping[str, Any], prefix: list[bytes], body: Spans,
                 deadline: float) -> None:
        self.child, self.prefix, self.body, self.deadline = child, prefix, body, deadline
        self.q: queue.Queue = queue.Queue()

    def __len__(self) -> int:
        return sum(len(p) for p in self.prefix) + len(self.body)

    def piece(self, a: int, b: int) -> Any:
        """The bytes sent for piece [a, b) (a test engine overrides this to tamper or stall)."""
        return self.body.parts(a, b)

    def __iter__(self):  # noqa: ANN204
        yield from self.prefix
        while True:
            item = self.q.get(timeout=max(0.01, self.deadline - time.monotonic()))
            if item is _END:
                return
            if item is None:
                raise PayloadError("upstream bytes were refused; this child's frame is cut off")
            out = self.piece(*item)
            yield from out if isinstance(out, list) else (out,)

    def post(self, me: str, index: int, stall: float) -> None:
        """The child answers the trainer itself; a failure here is only logged."""
        c = self.child
        headers = {**{str(k): str(v) for k, v in (c.get("headers") or {}).items()},
                   RELAY_HEADER: c["token"], "Content-Type": "application/octet-stream"}
        try:
            resp = requests.post(c["url"], data=self, headers=headers,
                                 timeout=(min(stall, 10.0), max(stall, 1.0)),
                                 verify=c.get("verify", True))
            if resp.status_code != 200:
                log.info("relay %s -> %s, bucket %d: HTTP %d %s", me, c["name"], index,
                         resp.status_code, resp.text[:200])
        except Exception as e:  # noqa: BLE001 - the child tells the trainer, which feeds it
            log.info("relay %s -> %s, bucket %d failed: %s: %s", me, c["name"], index,
                     type(e).__name__, e)


def relay(session: Any, desk: Desk, header: Mapping[str, Any],
          read_into: Callable[[memoryview], int], nbytes: int,
          cancel: Callable[[], None] | None = None) -> dict[str, Any]:
    """Receive one forwarded payload: check, forward, stage; the outcome goes to `desk` for the
    trainer's long poll. `cancel` shuts this request's connection."""
    e = desk.get(header.get("index"))
    if dict(header) != e.header or nbytes != e.nbytes:
        err = Tampered(f"relay refused: bucket {e.index}'s header from relay {e.parent} is not "
                       f"the one the trainer announced to this member")
        desk.record(e, entry(e.ack_key, e.index, "tampered", e.parent, error=str(err)))
        raise err
    streams = session.streams(e.header)
    if streams:
        desk.start(e, cancel)
    else:
        desk.moved(e, 0)
    try:
        digest = _carry(session, desk, e, read_into, nbytes, streams)
    except Tampered as err:
        desk.record(e, entry(e.ack_key, e.index, "tampered", e.parent, error=str(err)))
        raise
    except Exception as err:
        desk.record(e, {"status": "error", "error": f"{type(err).__name__}: {err}"})
        raise
    finally:
        desk.release(e)
    desk.record(e, entry(e.ack_key, e.index, "ok", digest))
    return {"status": "staged", "digest": digest, "streamed": streams}


def _carry(session: Any, desk: Desk, e: Expectation, read_into: Callable[[memoryview], int],
           nbytes: int, streams: bool) -> str:
    """Read, check and pass on every piece, and stage the body (as it lands, or once whole)."""
    feeds: list[Feed] = []

    def check(k: int, got: str) -> None:
        if got != e.pieces[k]:
            raise Tampered(f"bucket {e.index}, piece {k}: the bytes from relay {e.parent} do "
                           f"not match the digest the trainer announced; nothing of this "
                           f"bucket was kept or forwarded")
        desk.moved(e, k + 1)
        if k == len(e.pieces) - 1:
            desk.claim(e)

    def ready(a: int, b: int) -> None:
        for f in feeds:
            f.q.put((a, b))

    buf = None if streams else bytearray(nbytes)
    landing = Landing(read_into, nbytes, e.piece_bytes, check, ready, f"bucket {e.index}", buf)
    prefix = [bytes(p) for p in frame(e.header, b"")[:2]]
    feeds += [Feed(c, prefix, landing.spans, e.deadline) for c in e.children]
    for f in feeds:
        threading.Thread(target=f.post, args=(e.name, e.index, e.stall), daemon=True,
                         name="ws-relay-feed").start()
    ok, digest = False, ""
    try:
        if buf is None:
            digest = session.apply_stream(e.header, landing, nbytes)
        else:
            read_exact(landing, memoryview(buf))
        ok = landing.piece == len(e.pieces)
    finally:
        for f in feeds:
            f.q.put(_END if ok else None)
    if not e.claimed:
        desk.claim(e)                 # an empty body has no last piece
    if buf is None:
        return digest
    return _STAGER.submit(session.apply, e.header, memoryview(buf)).result()
