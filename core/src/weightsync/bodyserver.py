"""Payload bodies in binary for receivers that pull them: the sender publishes a body on a small
HTTP server of its own and tells the receiver where (URL + one-time token), and the receiver
fetches it straight into its staging buffers (`fetch`). Engines whose weight route takes only
JSON (vLLM's /update_weights) get the bytes this way instead of as base64 inside the JSON; a
member joining a fleet can take its catch-up the same way from a peer.

Hardened like every weightsync service (`weightsync.httpserver`): bound to loopback unless told
otherwise; every body has its own random 128-bit token, checked (constant time) before anything
is sent, and is served to at most `fetches` requests (default one) and only while published;
nothing is ever written to the server (GET only, no request body); idle and slow clients time
out; connections are capped. The fetching side checks the status, that Content-Length is the
size it expects (and at most its cap), and times out."""

from __future__ import annotations

import hmac
import http.client
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import torch

from .errors import PayloadError, TransportError
from .httpserver import HttpError, Routes, make_server

TOKEN_HEADER = "Authorization"
ROUTE = "/weightsync/body"


@dataclass
class _Body:
    view: memoryview
    token: str
    left: int                       # fetches still allowed


class BodyServer:
    """Serves published bodies at GET /weightsync/body?id=ID with `Authorization: Bearer TOKEN`.
    Runs on a daemon thread from the first `publish` until `close`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, advertise: str | None = None,
                 timeout: float = 60.0, max_connections: int = 16) -> None:
        self.host, self.port, self.advertise = host, port, advertise
        self.timeout, self.max_connections = timeout, max_connections
        self._bodies: dict[str, _Body] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- serving ------------------------------------------------------------------------------
    def _route(self, h: Any, q: dict[str, list[str]]) -> Any:
        bid = (q.get("id") or [""])[0]
        got = h.headers.get(TOKEN_HEADER, "")
        with self._lock:
            body = self._bodies.get(bid)
            ok = body is not None and hmac.compare_digest(got.encode("utf-8", "surrogateescape"),
                                                          f"Bearer {body.token}".encode())
            if ok:
                body.left -= 1
                if body.left <= 0:
                    del self._bodies[bid]
        if not ok:                  # unknown, withdrawn, already fetched or a wrong token: alike
            raise HttpError(404, "no such body (it was withdrawn, already fetched, or the token is wrong)")
        return body.view, "application/octet-stream"

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

    def publish(self, body: torch.Tensor | memoryview | bytes, fetches: int = 1) -> dict[str, Any]:
        """Serve `body` (held, not copied: keep it unchanged until `withdraw`) to at most
        `fetches` requests. Returns what the receiver needs: {"url", "token", "nbytes"}."""
        if isinstance(body, torch.Tensor):
            if body.device.type != "cpu" or not body.is_contiguous():
                raise ValueError("a published body must be a contiguous CPU tensor")
            view = memoryview(body.reshape(-1).view(torch.uint8).numpy()) if body.numel() else memoryview(b"")
        else:
            view = memoryview(body).cast("B")
        bid, token = secrets.token_hex(8), secrets.token_urlsafe(16)
        url = self.url
        with self._lock:
            self._bodies[bid] = _Body(view, token, fetches)
        return {"url": f"{url}?id={bid}", "token": token, "nbytes": len(view)}

    def withdraw(self, ref: dict[str, Any] | None = None) -> None:
        """Stop serving one published body (`ref` from publish), or all of them."""
        with self._lock:
            if ref is None:
                self._bodies.clear()
                return
            bid = urlsplit(str(ref.get("url", ""))).query.removeprefix("id=")
            self._bodies.pop(bid, None)

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
def fetch(ref: dict[str, Any], consume: Callable[[Callable[[memoryview], int], int], Any], *,
          max_bytes: int, timeout: float = 60.0) -> Any:
    """GET a published body and hand its stream to `consume(read_into, nbytes)` (which must read
    exactly nbytes: `receiver.read_staged`, `receiver.read_exact`); returns what it returns.
    Refuses anything but plain http, a body of another size than `ref["nbytes"]`, or over
    `max_bytes`."""
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
        try:
            conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""),
                         headers={TOKEN_HEADER: f"Bearer {token}"})
            resp = conn.getresponse()
        except OSError as e:
            raise TransportError(f"could not fetch the payload body from {parts.netloc}: {e}") from None
        if resp.status != 200:
            raise TransportError(f"fetching the payload body from {parts.netloc} got HTTP "
                                 f"{resp.status}: {resp.read(2000)[:200]!r}")
        length = resp.getheader("Content-Length")
        if length is None or int(length) != nbytes:
            raise PayloadError(f"the body server sent {length} bytes, {nbytes} were announced")
        return consume(resp.readinto, nbytes)
    finally:
        conn.close()
