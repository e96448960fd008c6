"""The `http` transport retries a payload only where its option says: on a connection that failed
before any answer (a dropped keep-alive socket). A request that timed out may have been taken by
the engine (it can still be reading the body), so it is never sent a second time. Real sockets:
a server that drops the first connections, and one that reads the body and never answers."""

from __future__ import annotations

import socket
import threading
from typing import Iterator

import pytest
import torch

from weightsync_reference.adapter import ReferenceAdapter
from weightsync.config import EngineSpec
from weightsync.encodings.raw import RawEncoding
from weightsync.errors import EngineUnavailable, EngineUnreachable
from weightsync.transports.http.sending import HttpOptions, HttpTransport
from weightsync.wire.bucket import Bucket


class Server:
    """Counts the payload requests it reads whole; drops the first `drop` connections after
    reading the request, answers the rest with 200, or (`silent`) never answers."""

    def __init__(self, drop: int = 0, silent: bool = False) -> None:
        self.drop, self.silent, self.requests = drop, silent, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _read_request(self, conn: socket.socket) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            body += chunk
        return True

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._read_request(conn):
                conn.close()
                continue
            self.requests += 1
            if self.silent:
                self.held.append(conn)              # read it all, answer never
            elif self.requests <= self.drop:
                conn.close()                        # gone before any answer
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server(**request.param)
    yield s
    s.close()


def post(server: Server, retries: int, timeout: float = 30.0) -> None:
    transport = HttpTransport(HttpOptions(retries=retries, timeout=timeout))
    adapter = ReferenceAdapter(engine=EngineSpec(url=server.url, name="e"))
    payload = RawEncoding().encode(Bucket(0, [("w", torch.arange(64, dtype=torch.float32))], True))
    try:
        transport._post(adapter, payload, payload.body, 0)
    finally:
        transport.close()
        adapter.close()


@pytest.mark.parametrize("server", [{"drop": 1}], indirect=True)
def test_a_dropped_connection_is_tried_again(server: Server) -> None:
    post(server, retries=1)
    assert server.requests == 2


@pytest.mark.parametrize("server", [{"drop": 5}], indirect=True)
def test_the_retries_are_bounded(server: Server) -> None:
    with pytest.raises(EngineUnreachable):
        post(server, retries=2)
    assert server.requests == 3


@pytest.mark.parametrize("server", [{"silent": True}], indirect=True)
def test_a_timeout_is_never_sent_twice(server: Server) -> None:
    with pytest.raises(EngineUnavailable, match="no answer within"):
        post(server, retries=3, timeout=1.0)
    assert server.requests == 1
