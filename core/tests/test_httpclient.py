"""Talking HTTP to engines over real sockets: a connection that an engine's server drops after an
error answer is not reused, and a failed call says whether the engine refused or dropped it."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from weightsync.errors import EngineError, EngineUnreachable
from weightsync.httpclient import call, session_for


class ClosingAfterErrors:
    """A keep-alive HTTP/1.1 server that behaves like uvicorn after an unhandled exception: it
    answers 500 without `Connection: close`, then closes the socket a moment later, unread
    requests and all (the peer gets a reset)."""

    def __init__(self, linger_s: float = 0.3) -> None:
        self.linger_s = linger_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                path = line.split()[1].decode()
                length = 0
                while (h := f.readline()) not in (b"\r\n", b""):
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":")[1])
                f.read(length)
                ok = path == "/ok"
                body = json.dumps({"ok": True} if ok else {"error": "boom"}).encode()
                status = b"200 OK" if ok else b"500 Internal Server Error"
                conn.sendall(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body))
                if not ok:
                    time.sleep(self.linger_s)      # logging the traceback, then closing
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
        finally:
            f.close()
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def server() -> Iterator[ClosingAfterErrors]:
    s = ClosingAfterErrors()
    yield s
    s.close()


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
