"""A member that passes payloads on (the `http` transport's chain and tree shapes), engine side.

The trainer first tells each member, over the member's own authenticated channel, what bucket
`index` will be: its header, the digest of every piece, who this member feeds (each child's
relay URL, round id and relay token) and a key for signing its answer (`Desk.expect`). The
bytes then arrive from the parent (`relay`): every piece is checked against the announced
digest before it is forwarded to the children or kept; a piece that does not match stops the
bucket here (nothing of it is staged or forwarded further) and the answer, signed, says the
parent tampered. Each child is fed on its own thread while later pieces still arrive, so the
bucket moves down the tree a piece behind each hop, not a bucket. Once the body is whole it is
staged like any payload (`ReceiveSession.apply`: signature, decode, digest), and the answer
lists every member of this subtree with its signed outcome.

What a relay learns: the payload (which it receives anyway), and per child a URL, a round id and
a relay token that lets it post payload bytes to that child in this round only. It never sees a
child's API key or answer key, so it can drop a descendant's answer (the trainer then feeds that
member itself) but cannot forge one, and bytes it changes are refused by the next hop."""

from __future__ import annotations

import hmac
import queue
import threading
import time
from typing import Any, Callable, Mapping

import requests

from ..errors import PayloadError
from ..pieces import entry, piece_digest
from ..wire import frame
from .staging import read_exact

RELAY_HEADER = "X-Weightsync-Relay"
_END = object()


class Tampered(PayloadError):
    """A piece that does not match the digest the trainer announced; `members`: the answer."""

    def __init__(self, message: str, members: dict[str, Any]) -> None:
        super().__init__(message)
        self.members = members


class Expectation:
    """What the trainer announced for one bucket (checked on arrival)."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        try:
            self.index = int(body["index"])
            self.header = dict(body["header"])
            self.nbytes = int(self.header["nbytes"])
            self.pieces = [str(p) for p in body["pieces"]]
            self.piece_bytes = int(body["piece_bytes"])
            self.name = str(body["name"])
            self.ack_key = str(body["ack_key"])
            self.stall = float(body.get("stall", 30.0))
            self.left = float(body.get("left", 300.0))
            self.children = [dict(c) for c in body.get("children") or []]
            for c in self.children:
                c["url"], c["name"], c["token"] = str(c["url"]), str(c["name"]), str(c["token"])
                c["subtree"] = [str(n) for n in c.get("subtree") or [c["name"]]]
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"relay expectation is malformed ({type(e).__name__}: {e}); the "
                               f"trainer sends index, header, pieces, piece_bytes, name, ack_key")
        if self.piece_bytes <= 0 or len(self.pieces) != -(-self.nbytes // self.piece_bytes):
            raise PayloadError(f"bucket {self.index}: {len(self.pieces)} piece digests do not "
                               f"cover {self.nbytes} bytes in pieces of {self.piece_bytes}")
        self.deadline = time.monotonic() + self.left


class Desk:
    """A round's relay state: the relay token the trainer gave this member and the expected
    buckets."""

    def __init__(self) -> None:
        self.token: str | None = None
        self.expected: dict[int, Expectation] = {}
        self.lock = threading.Lock()

    def expect(self, body: Mapping[str, Any]) -> None:
        e = Expectation(body)
        token = body.get("token")
        if not isinstance(token, str) or len(token) < 16:
            raise PayloadError("relay expectation lacks a relay token of at least 16 characters")
        with self.lock:
            self.token = token
            self.expected[e.index] = e

    def check_token(self, got: str | None) -> None:
        """Before any body byte is read: only a parent the trainer named may post."""
        want = self.token
        if want is None or not isinstance(got, str) or not hmac.compare_digest(got, want):
            raise PayloadError("relay refused: no relay token, or not the one the trainer gave "
                               "this member for this round")

    def get(self, index: Any) -> Expectation:
        with self.lock:
            e = self.expected.get(int(index)) if isinstance(index, int) else None
        if e is None:
            raise PayloadError(f"relay refused: the trainer announced no bucket {index!r} to this "
                               f"member in this round")
        return e


class Feed:
    """The frame for one child, sent while its pieces still arrive (an iterable body with a
    Content-Length: requests streams it)."""

    def __init__(self, child: Mapping[str, Any], prefix: list[bytes], body: memoryview,
                 deadline: float) -> None:
        self.child, self.prefix, self.body, self.deadline = child, prefix, body, deadline
        self.q: queue.Queue = queue.Queue()
        self.result: dict[str, Any] = {}

    def __len__(self) -> int:
        return sum(len(p) for p in self.prefix) + len(self.body)

    def piece(self, a: int, b: int) -> Any:
        """The bytes sent for piece [a, b) (a test engine overrides this to tamper)."""
        return self.body[a:b]

    def __iter__(self):  # noqa: ANN204
        yield from self.prefix
        while True:
            item = self.q.get(timeout=max(0.01, self.deadline - time.monotonic()))
            if item is _END:
                return
            if item is None:
                raise PayloadError("upstream bytes were refused; this child's frame is cut off")
            yield self.piece(*item)

    def post(self, me: str, index: int, stall: float) -> None:
        c = self.child
        headers = {**{str(k): str(v) for k, v in (c.get("headers") or {}).items()},
                   RELAY_HEADER: c["token"], "Content-Type": "application/octet-stream"}
        try:
            resp = requests.post(c["url"], data=self, headers=headers,
                                 timeout=(min(stall, 10.0), max(stall, 1.0)),
                                 verify=c.get("verify", True))
            got = resp.json() if resp.content else {}
            members = got.get("members") if isinstance(got, dict) else None
            if isinstance(members, dict):
                self.result = members
            why = got.get("error") if isinstance(got, dict) else None
            if resp.status_code != 200 or not members:
                why = why or f"HTTP {resp.status_code}"
            else:
                why = None
        except Exception as e:  # noqa: BLE001 - the child's subtree is reported, not raised
            why = f"{type(e).__name__}: {e}"
        for n in c["subtree"]:
            if n not in self.result:
                self.result[n] = {"status": "error",
                                  "error": f"bucket {index} through relay {me} to {c['name']} "
                                           f"failed: {why or 'no answer for this member'}"}


def relay(session: Any, desk: Desk, header: Mapping[str, Any],
          read_into: Callable[[memoryview], int], nbytes: int) -> dict[str, Any]:
    """Receive one forwarded payload (see the module docstring): check, forward, stage.
    Returns {"members": {name: signed outcome}} for this member's subtree."""
    e = desk.get(header.get("index"))
    if dict(header) != e.header or nbytes != e.nbytes:
        raise PayloadError(f"relay refused: bucket {e.index}'s header is not the one the trainer "
                           f"announced to this member")
    buf = bytearray(nbytes)
    body = memoryview(buf)
    feeds = [Feed(c, [bytes(p) for p in frame(e.header, b"")[:2]], body, e.deadline)
             for c in e.children]
    threads = [threading.Thread(target=f.post, args=(e.name, e.index, e.stall), daemon=True,
                                name="ws-relay-feed") for f in feeds]
    for t in threads:
        t.start()
    base = _address(buf)
    ok = False
    try:
        for k, a in enumerate(range(0, nbytes, e.piece_bytes)):
            b = min(nbytes, a + e.piece_bytes)
            try:
                read_exact(read_into, body[a:b])
            except PayloadError as cut:
                raise PayloadError(f"bucket {e.index}, piece {k}: the relayed {cut}") from None
            if piece_digest(base + a, b - a) != e.pieces[k]:
                raise Tampered(
                    f"bucket {e.index}, piece {k}: the bytes from the relay do not match the "
                    f"digest the trainer announced; nothing of this bucket was kept or forwarded",
                    {e.name: entry(e.ack_key, e.index, "tampered", "parent",
                                   error=f"piece {k} of bucket {e.index} did not match")})
            for f in feeds:
                f.q.put((a, b))
        ok = True
    except Tampered as err:
        for f in feeds:
            f.q.put(None)
        for t, f in zip(threads, feeds):
            t.join(max(0.0, e.deadline - time.monotonic()))
            err.members.update(f.result)
        raise
    finally:
        for f in feeds:
            f.q.put(_END if ok else None)
    members: dict[str, Any] = {}
    try:
        digest = session.apply(e.header, body)
        members[e.name] = entry(e.ack_key, e.index, "ok", digest)
    except Exception as err:  # noqa: BLE001 - this member's outcome, reported with the others
        members[e.name] = {"status": "error", "error": f"{type(err).__name__}: {err}"}
    for t, f in zip(threads, feeds):
        t.join(max(0.0, e.deadline - time.monotonic()))
        members.update(f.result if not t.is_alive() else
                       {n: {"status": "error", "error": f"relay {e.name}: no answer from "
                                                        f"{f.child['name']} before the deadline"}
                        for n in f.child["subtree"]})
    return {"members": members}


def _address(buf: bytearray) -> int:
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if len(buf) else 0
