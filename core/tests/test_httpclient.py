"""Talking HTTP to engines over real sockets: a connection that an engine's server drops after an
error answer is not reused, and a failed call says whether the engine refused or dropped it."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from weightsync.errors import EngineError, EngineUnreachable
from weightsync.net.client import call, session_for


class ClosingAfterErrors(ThreadingHTTPServer):
    """A keep-alive HTTP/1.1 server that behaves like uvicorn after an unhandled exception: it
    answers 500 without `Connection: close`, then closes the socket a moment later, unread
    requests and all (the peer gets a reset)."""

    daemon_threads = True

    def __init__(self, linger_s: float = 0.3) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.linger_s = linger_s
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.connections = 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections += 1
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.close_request(request)         # a plain close, as uvicorn's (no FIN first)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ClosingAfterErrors

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        ok = self.path == "/ok"
        body = json.dumps({"ok": True} if ok else {"error": "boom"}).encode()
        self.send_response(200 if ok else 500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        if not ok:
            time.sleep(self.server.linger_s)     # logging the traceback, then closing
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ClosingAfterErrors]:
    s = ClosingAfterErrors()
    yield s
    s.shutdown()
    s.server_close()


def test_the_call_after_an_error_answer_opens_a_fresh_connection(
        server: ClosingAfterErrors) -> None:
    session = session_for(None)
    for _ in range(3):
        with pytest.raises(EngineError, match="HTTP 500: boom"):
            call(session, "e", "POST", server.url + "/boom", timeout=5, json={})
        ok = call(session, "e", "POST", server.url + "/ok", timeout=5, json={})
        assert ok.json() == {"ok": True}
    assert server.connections == 4          # the first, then a fresh one after each error answer


def test_a_reused_connection_that_was_dropped_says_so(server: ClosingAfterErrors) -> None:
    """The hazard the fresh connection avoids, shown with the session used directly."""
    session = session_for(None)
    session.post(server.url + "/boom", json={}, timeout=5)
    with pytest.raises(EngineUnreachable, match=r"connection lost \(Connection reset by peer\)"):
        call(session, "e", "POST", server.url + "/ok", timeout=5, json={})


def test_a_refused_connection_says_so() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                  # bound, never listening: refused
        refused = r"cannot connect \(Connection refused\); is the engine"
        with pytest.raises(EngineUnreachable, match=refused):
            call(session_for(None), "ghost", "GET", f"http://127.0.0.1:{port}/health", timeout=5)
