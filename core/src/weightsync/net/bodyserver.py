"""Payload bodies in binary for receivers that pull them: the sender publishes a body on an HTTP
server of its own and tells the receiver where (URL + one-time token), and the receiver fetches it
straight into its staging buffers (`fetch`): vLLM's JSON-only weight route gets bytes, not base64.
Hardened like every weightsync service: loopback unless told otherwise, a random token per body
checked in constant time, at most `fetches` requests per body, GET only. A `Live` body is served
while it still arrives (a relay member passing on checked pieces), from any `offset`."""

from __future__ import annotations

import hmac
import http.client
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch

from weightsync.errors import PayloadError, TransportError
from weightsync.net.server import HttpError, Routes, Streamed, make_server
from weightsync.wire.bucket import tensor_bytes

__all__ = ["BodyServer", "Live", "REASON_HEADER", "ROUTE", "TOKEN_HEADER", "fetch"]

TOKEN_HEADER = "Authorization"
REASON_HEADER = "X-Weightsync-Reason"       # why a relay member fetches from the trainer
ROUTE = "/weightsync/body"
_PART = 1 << 20                             # bytes per write of a live body


class Live:
    """A body that fills while it is served: `ready(n)` says the first n bytes are final,
    `fail()` that no more will come (a fetch then ends short, never with bytes not ready)."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.watermark = 0
        self.failed = False
        self.served = 0                     # bytes written to fetchers
        self._cond = threading.Condition()

    def ready(self, upto: int) -> None:
        with self._cond:
            self.watermark = max(self.watermark, min(upto, len(self.view)))
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self.failed = True
            self._cond.notify_all()

    def parts(self, offset: int, stall: float) -> Iterator[memoryview]:
        """The body from `offset`, each part once ready, until it fails or stalls for `stall` s."""
        sent, end = offset, len(self.view)
        while sent < end:
            with self._cond:
                if not self._cond.wait_for(lambda: self.watermark > sent or self.failed,  # noqa: B023 - called here
                                           stall):
                    raise TimeoutError(f"no new bytes for {stall:g}s")
                if self.watermark <= sent:
                    raise ConnectionAbortedError("the body will not be completed")
                upto = min(self.watermark, sent + _PART)
            yield self.view[sent:upto]
            with self._cond:
                self.served += upto - sent
            sent = upto


@dataclass
class _Body:
    view: memoryview | Live
    token: str
    left: int                       # fetches still allowed
    on_fetch: Callable[[Mapping[str, str]], None] | None = None   # told each fetch's headers


class BodyServer:
    """Serves published bodies at GET /weightsync/body?id=ID (`Authorization: Bearer TOKEN`)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, advertise: str | None = None,
                 timeout: float = 60.0, max_connections: int = 16, linger: float = 0.0) -> None:
        """`linger`: seconds a fetch of an id not offered yet waits for it."""
        self.host, self.port, self.advertise = host, port, advertise
        self.timeout, self.max_connections, self.linger = timeout, max_connections, linger
        self._bodies: dict[str, _Body] = {}
        self._lock = threading.Condition()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- serving ------------------------------------------------------------------------------
    def _route(self, h: Any, q: dict[str, list[str]]) -> Any:
        bid = (q.get("id") or [""])[0]
        got = h.headers.get(TOKEN_HEADER, "")
        try:
            offset = int((q.get("offset") or ["0"])[0])
        except ValueError:
            raise HttpError(400, "offset must be a whole number of bytes") from None
        with self._lock:
            if self.linger > 0 and bid not in self._bodies:
                self._lock.wait_for(lambda: bid in self._bodies, self.linger)
            body = self._bodies.get(bid)
            ok = body is not None and hmac.compare_digest(got.encode("utf-8", "surrogateescape"),
                                                          f"Bearer {body.token}".encode())
            if ok and body is not None:
                body.left -= 1
                if body.left <= 0:
                    del self._bodies[bid]
        if not ok or body is None:  # unknown, withdrawn, already fetched or a wrong token: alike
            raise HttpError(404, "no such body (it was withdrawn, already fetched, or the token is wrong)")
        n = len(body.view.view if isinstance(body.view, Live) else body.view)
        if not 0 <= offset <= n:
            raise HttpError(400, f"offset {offset} is outside the body's {n} bytes")
        if body.on_fetch is not None:
            body.on_fetch(h.headers)
        if isinstance(body.view, Live):
            return Streamed(n - offset, body.view.parts(offset, self.timeout))
        return body.view[offset:], "application/octet-stream"

    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            routes = Routes()
            routes.add("GET", ROUTE, auth=False, max_body=0)(self._route)
            self._server = make_server(routes, self.host, self.port, api_key=None, name="body server",
                                       max_connections=self.max_connections,
                                       header_timeout=self.timeout, body_timeout=self.timeout)
            self.port = self._server.server_address[1]
            self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                            name="ws-body-server", daemon=True)
            self._thread.start()

    @property
    def url(self) -> str:
        self.start()
        return f"http://{self.advertise or self.host}:{self.port}{ROUTE}"

    def publish(self, body: torch.Tensor | memoryview | bytes, fetches: int = 1,
                on_fetch: Callable[[Mapping[str, str]], None] | None = None) -> dict[str, Any]:
        """Serve `body` (held, not copied) to at most `fetches` requests (`on_fetch` is told each
        one's headers); returns what the receiver needs: {"url", "token", "nbytes"}."""
        if isinstance(body, torch.Tensor):
            if body.device.type != "cpu" or not body.is_contiguous():
                raise ValueError("a published body must be a contiguous CPU tensor")
            view = tensor_bytes(body)
        else:
            view = memoryview(body).cast("B")
        bid, token = secrets.token_hex(8), secrets.token_urlsafe(16)
        url = self.url
        with self._lock:
            self._bodies[bid] = _Body(view, token, fetches, on_fetch)
        return {"url": f"{url}?id={bid}", "token": token, "nbytes": len(view)}

    def offer(self, bid: str, token: str, body: Live, fetches: int) -> None:
        """Serve a body that still arrives under an id and token the trainer chose."""
        if not (bid and token and fetches > 0):
            raise PayloadError("an offered body needs an id, a token and at least one fetch")
        self.start()
        with self._lock:
            if bid in self._bodies:
                raise PayloadError(f"body {bid} is already offered")
            self._bodies[bid] = _Body(body, token, fetches)
            self._lock.notify_all()

    def withdraw(self, ref: dict[str, Any] | None = None) -> None:
        """Stop serving one published body (`ref` from publish), or all of them."""
        if ref is not None:
            self.withdraw_id(urlsplit(str(ref.get("url", ""))).query.removeprefix("id="))
            return
        with self._lock:
            every = list(self._bodies.values())
            self._bodies.clear()
            for b in every:
                if isinstance(b.view, Live):
                    b.view.fail()

    def withdraw_id(self, bid: str) -> None:
        """Stop serving an offered body (its fetches in progress end short)."""
        with self._lock:
            gone = self._bodies.pop(bid, None)
        if gone is not None and isinstance(gone.view, Live):
            gone.view.fail()

    def published(self) -> int:
        with self._lock:
            return len(self._bodies)

    def close(self) -> None:
        self.withdraw()
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


# -- fetching ---------------------------------------------------------------------------------
def fetch(ref: Mapping[str, Any], consume: Callable[[Callable[[memoryview], int], int], Any], *,
          max_bytes: int, timeout: float = 60.0, offset: int = 0,
          headers: Mapping[str, str] | None = None) -> Any:
    """GET a published body (from byte `offset`) and return `consume(read_into, nbytes)`, which
    reads exactly nbytes; refuses anything but plain http, another size, or over `max_bytes`."""
    try:
        url, token, nbytes = str(ref["url"]), str(ref["token"]), int(ref["nbytes"])
    except (KeyError, TypeError, ValueError):
        raise PayloadError("a fetch reference needs url, token and nbytes") from None
    if not 0 <= nbytes <= max_bytes:
        raise PayloadError(f"a body of {nbytes} bytes is over this receiver's limit of {max_bytes}")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise PayloadError(f"body URL {url!r} is not a plain http URL")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        query = "&".join(x for x in (parts.query, f"offset={offset}" if offset else "") if x)
        try:
            conn.request("GET", parts.path + (f"?{query}" if query else ""),
                         headers={**(headers or {}), TOKEN_HEADER: f"Bearer {token}"})
            resp = conn.getresponse()
        except OSError as e:
            raise TransportError(f"could not fetch the payload body from {parts.netloc}: {e}") from None
        if resp.status != 200:
            raise TransportError(f"fetching the payload body from {parts.netloc} got HTTP "
                                 f"{resp.status}: {resp.read(2000)[:200]!r}")
        length = resp.getheader("Content-Length")
        if length is None or int(length) != nbytes - offset:
            raise PayloadError(f"the body server sent {length} bytes, {nbytes - offset} were "
                               f"announced")
        return consume(resp.readinto, nbytes - offset)
    finally:
        conn.close()
