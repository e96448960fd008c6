"""The HTTP server under every weightsync service (reference engine, fleet registry, peer
source): the standard library's threading server with the limits a networked service needs. The
key is checked before any body is read, a body's length against the route's cap before anything
is allocated (413), and bodies are read in chunks; heads are capped and have a deadline, and
unproven slow heads are shed (`weightsync.net.guard`); connections are capped (503); any
malformed request is a 4xx, never a 500. Routes are functions on a `Routes` table:
`(handler, query) -> result`, sent as JSON (dict), octet-stream (bytes) or streamed (`Streamed`)."""

from __future__ import annotations

import contextlib
import hmac
import http.client
import json
import logging
import socket
import threading
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs, urlparse

from weightsync.errors import PayloadError, WeightSyncError
from weightsync.net.body import BodyStream
from weightsync.net.guard import HeadGuard, HeadReader

__all__ = ["Conflict409", "Handler", "HttpError", "MiB", "Route", "Routes", "Server", "Streamed",
           "free_port", "make_server"]

log = logging.getLogger("weightsync.http")
MiB = 2**20


def free_port(host: str = "") -> int:
    """A port nobody listens on right now on this host (every address with `host` "")."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class HttpError(WeightSyncError):
    """A request refused with a status and a message that says what to do."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


@dataclass
class Streamed:
    """A binary answer of `nbytes` from `parts`; one that stops short closes the connection."""
    nbytes: int
    parts: Iterable[memoryview]


@dataclass
class Route:
    fn: Callable[["Handler", dict[str, list[str]]], Any]
    auth: bool = True
    max_body: int | Callable[[], int] = MiB          # bytes, or a function of the server's state
    keys: tuple[str, ...] = ()           # handler attributes holding keys it takes beside api_key

    def cap(self) -> int:
        return self.max_body() if callable(self.max_body) else self.max_body


class Routes:
    """(method, path) -> Route, with a decorator to fill it."""

    def __init__(self) -> None:
        self.table: dict[tuple[str, str], Route] = {}

    def add(self, method: str, path: str, *, auth: bool = True,
            max_body: int | Callable[[], int] = MiB, keys: tuple[str, ...] = ()
            ) -> Callable[[Any], Any]:
        def deco(fn: Any) -> Any:
            self.table[(method, path)] = Route(fn, auth, max_body, keys)
            return fn
        return deco


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.1"  # even a garbage request line gets a status line back
    disable_nagle_algorithm = True
    timeout = 15.0                       # seconds any one read of a head may wait (and idle keep-alive)
    body_timeout = 120.0                 # seconds any one read of a body may wait
    head_bytes = 64 * 1024               # request line and headers together
    proven = False                       # showed the key (or got an answer): never evicted
    _length: int                         # body bytes not read yet (unset: Content-Length not read)
    routes: Routes
    api_key: str | None = None
    name = "weightsync"
    server_version = "weightsync"
    sys_version = ""

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    # -- bodies -------------------------------------------------------------------------------
    def body_length(self) -> int:
        raw = self.headers.get("Content-Length")
        if raw is None or raw.strip() == "":
            return 0
        try:
            n = int(raw)
        except ValueError:
            raise HttpError(400, f"Content-Length {raw!r} is not a number") from None
        if n < 0:
            raise HttpError(400, f"Content-Length {n} is negative")
        return n

    def _take_length(self) -> int:
        """The body's length, once: what is read after this is the route's."""
        n = self._length if hasattr(self, "_length") else self.body_length()
        self._length = 0
        return n

    def read_body(self) -> memoryview:
        """The request body, read in chunks (memory follows what arrives) into one buffer."""
        n = self._take_length()
        if n == 0:
            return memoryview(b"")
        buf = bytearray()
        while len(buf) < n:             # grows with what arrives, never with what is announced
            chunk = self.rfile.read1(min(4 * MiB, n - len(buf)))
            if not chunk:
                raise HttpError(400, f"request body ended after {len(buf)} of {n} bytes")
            buf += chunk
        return memoryview(buf)

    def body_reader(self, gather: int = 0) -> BodyStream:
        """The request body as a stream (`read_into(view)`), never past its Content-Length."""
        return BodyStream(self, self._take_length(), gather)

    def json_body(self) -> Any:
        raw = self.read_body()
        if not raw:
            return {}
        try:
            return json.loads(bytes(raw))
        except ValueError as e:
            raise HttpError(400, f"request body is not JSON: {e}") from None

    def discard_body(self) -> None:
        """Drain a refused request's small body (the connection stays usable), else close."""
        n = getattr(self, "_length", 0) or 0
        if n <= 64 * 1024:
            try:
                self.rfile.read(n)
            except OSError:
                self.close_connection = True
        else:
            self.close_connection = True
        self._length = 0

    # -- answers ------------------------------------------------------------------------------
    def send(self, status: int, body: bytes, ctype: str = "application/json",
             headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def send_stream(self, result: Streamed) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(result.nbytes))
        self.end_headers()
        sent = 0
        try:
            for part in result.parts:
                self.wfile.write(part)
                sent += len(part)
        except Exception as e:  # noqa: BLE001 - the head is out: only a short body can say it
            log.info("%s: a streamed answer stopped after %d of %d bytes: %s", self.name, sent,
                     result.nbytes, e)
        if sent != result.nbytes:
            self.close_connection = True

    def send_error_json(self, status: int, message: str, **extra: Any) -> None:
        self.send(status, json.dumps({"error": f"{self.name}: {message}", **extra}).encode())

    def _refuse(self, status: int, message: str, **extra: Any) -> None:
        """An error answer, after draining a body the route left unread (or closing)."""
        if getattr(self, "_length", 0):
            self.discard_body()
        self.send_error_json(status, message, **extra)

    def authorized(self, keys: tuple[str, ...] = ()) -> bool:
        """The API key, or one of the route's own narrower keys (`Routes.add(keys=...)`)."""
        if not self.api_key:
            return True
        got = self.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        want = [self.api_key, *(k for k in (getattr(self, a, None) for a in keys) if k)]
        return any(hmac.compare_digest(got, f"Bearer {k}".encode()) for k in want)

    # -- connections --------------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        self.rfile = HeadReader(self.rfile, self.head_bytes)  # type: ignore[assignment]

    def handle_one_request(self) -> None:
        """One request, its head under the guard: capped bytes, an absolute deadline."""
        self.rfile.start_head()  # type: ignore[attr-defined]
        self.server.guard.started(self)  # type: ignore[attr-defined]
        self.requestline, self.request_version, self.command = "", "HTTP/1.1", ""
        try:
            super().handle_one_request()
        except http.client.LineTooLong as e:      # the request line alone: 414
            status = 431 if self.requestline else 414
            self.send_error(status, f"{e}; send at most {self.head_bytes} bytes of head")
        finally:
            self.server.guard.ended(self)  # type: ignore[attr-defined]
            self.rfile.end_head()  # type: ignore[attr-defined]

    def _dispatch(self) -> None:
        method = self.command
        self.server.guard.ended(self)  # type: ignore[attr-defined]
        self.rfile.end_head()  # type: ignore[attr-defined]
        if getattr(self, "dropped", False):
            self.close_connection = True
            return
        url = urlparse(self.path)
        route = self.routes.table.get((method, url.path))
        self.connection.settimeout(self.body_timeout)
        try:
            self._length = self.body_length()
            if route is None:
                raise HttpError(404, f"no route {method} {url.path}")
            if route.auth and not self.authorized(route.keys):
                raise HttpError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
            if route.auth and self.api_key:
                self.proven = True
            cap = route.cap()
            if self._length > cap:
                self.close_connection = True
                raise HttpError(413, f"a body of {self._length} bytes is over this route's limit "
                                     f"of {cap} bytes")
            result = route.fn(self, parse_qs(url.query))
            if not self.api_key:
                self.proven = True       # no key to show: an answered request proves enough
            if self._length:
                self.discard_body()      # a route that ignored its body
            if isinstance(result, Streamed):
                self.send_stream(result)
            elif isinstance(result, (bytes, bytearray, memoryview)):
                self.send(200, bytes(result), "application/octet-stream")
            elif isinstance(result, tuple):          # (bytes, content type, headers)
                self.send(200, result[0], result[1], result[2] if len(result) > 2 else None)
            else:
                self.send(200, json.dumps(result if result is not None else {"ok": True}).encode())
        except HttpError as e:
            self._refuse(e.status, str(e), **e.extra)
        except Conflict409 as e:
            self._refuse(409, str(e))
        except (WeightSyncError, ValueError, KeyError, TypeError, OverflowError,
                NotImplementedError) as e:
            self._refuse(400, str(e) if not isinstance(e, KeyError) else f"missing field {e}")
        except (ConnectionError, socket.timeout):
            self.close_connection = True
        except Exception as e:  # the service keeps serving; the caller gets the reason
            log.error("%s %s failed:\n%s", method, url.path, traceback.format_exc())
            self._refuse(500, f"{type(e).__name__}: {e}")
        finally:
            with contextlib.suppress(OSError):
                self.connection.settimeout(self.timeout)

    do_GET = do_POST = do_PUT = do_DELETE = _dispatch

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals (bad request line, headers too long) as JSON."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.send_error_json(code, message or "bad request")


class Conflict409(PayloadError):
    """The request does not fit the service's state (HTTP 409)."""


class Server(ThreadingHTTPServer):
    """A threading server of at most `max_connections` connections (503 beyond)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[Handler], max_connections: int = 64,
                 head_deadline: float = 10.0) -> None:
        # threads are bounded by `slots`, unproven heads by the guard; set before binding (a port
        # in use fails in super().__init__, which then closes the server)
        self.slots = threading.BoundedSemaphore(4 * max_connections)
        self.max_connections = max_connections
        self.guard = HeadGuard(max_connections, head_deadline)
        self.open_conns: set[Any] = set()        # closed with the server: no keep-alive outlives it
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: 52\r\n\r\n"
                                b'{"error": "too many connections; try again shortly"}')
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer is routine; anything else is logged."""
        import sys
        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionError, TimeoutError, socket.timeout)):
            log.debug("client %s went away: %s", client_address, err)
            return
        log.error("serving %s failed:\n%s", client_address, traceback.format_exc())

    def server_close(self) -> None:
        self.guard.close()
        super().server_close()
        with self.guard.lock:
            conns, self.open_conns = list(self.open_conns), set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self.guard.lock:
            self.open_conns.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.guard.lock:
                self.open_conns.discard(request)
            self.slots.release()


def make_server(routes: Routes, host: str, port: int, *, api_key: str | None, name: str,
                state: dict[str, Any] | None = None, max_connections: int = 64,
                header_timeout: float = 15.0, body_timeout: float = 120.0,
                head_deadline: float = 10.0) -> Server:
    """A server for `routes`; `state` becomes attributes of the handler class (`h.engine`)."""
    attrs = {"routes": routes, "api_key": api_key, "name": name, "timeout": header_timeout,
             "body_timeout": body_timeout, **(state or {})}
    handler = type(f"{name.title().replace(' ', '')}Handler", (Handler,), attrs)
    return Server((host, port), handler, max_connections, head_deadline)
