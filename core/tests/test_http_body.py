"""Request bodies read in gathered receives (`BodyStream` with `gather`, SO_RCVLOWAT): every byte
arrives exactly, whatever the body's size against the gather and however the sender splits it;
a read never waits for bytes the body will not bring; and the connection's next request is
answered at once (the low-water mark is back to one byte)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from typing import Any, Iterator

import pytest
from weightsync.net.server import Routes, make_server

GATHER = 64 << 10
routes = Routes()


@routes.add("POST", "/body", auth=False, max_body=64 << 20)
def _body(h: Any, q: dict) -> Any:
    piece = int(q["piece"][0])
    read_into = h.body_reader(GATHER)
    buf = bytearray(read_into.left)
    woken = _sleeps()
    view, got, reads = memoryview(buf), 0, 0
    while got < len(buf):
        k = read_into(view[got: got + piece])
        assert k, "the body ended early"
        got, reads = got + k, reads + 1
    lowat = h.connection.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
    return {"sha256": hashlib.sha256(buf).hexdigest(), "reads": reads, "lowat": lowat,
            "sleeps": _sleeps() - woken}


def _sleeps() -> int:
    """How often this thread has blocked (and so been woken) so far."""
    with open("/proc/thread-self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    srv = make_server(routes, "127.0.0.1", 0, api_key=None, name="body test", body_timeout=20.0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _post(conn: socket.socket, body: bytes, piece: int, chunk: int, pace: float = 0.0
          ) -> dict[str, Any]:
    """POST `body` on an open connection, written `chunk` bytes at a time (`pace` seconds
    apart); the answer's JSON."""
    conn.sendall(f"POST /body?piece={piece} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}"
                 f"\r\n\r\n".encode())
    for i in range(0, len(body), chunk):
        conn.sendall(body[i: i + chunk])
        if pace:
            time.sleep(pace)
    f = conn.makefile("rb")
    status = f.readline()
    assert b" 200 " in status, status
    length = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return json.loads(f.read(length))


@pytest.mark.parametrize("size", [1, GATHER - 1, GATHER + 1, 3 * GATHER + 12345, 4 << 20])
@pytest.mark.parametrize("piece,chunk", [(256 << 10, 1448), (16 << 10, 64 << 10), (1 << 20, 1 << 20)])
def test_every_byte_arrives_and_the_next_request_is_answered(server: Any, size: int, piece: int,
                                                             chunk: int) -> None:
    body = os.urandom(size)
    with socket.create_connection(server.server_address[:2], timeout=20.0) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        got = _post(conn, body, piece, chunk)
        assert got["sha256"] == hashlib.sha256(body).hexdigest()
        assert got["lowat"] == 1
        # the same connection's next request: a small body, read at once
        again = _post(conn, b"x" * 10, piece, chunk)
        assert again["sha256"] == hashlib.sha256(b"x" * 10).hexdigest()


def test_a_body_that_trickles_in_is_read_in_gathered_receives(server: Any) -> None:
    """A sender that writes one segment at a time, more slowly than the reader reads (a paced
    link): each receive still waits for a gather's worth, so the reading thread sleeps and
    wakes a handful of times per 256 KiB piece, not once per segment."""
    body, piece = os.urandom(2 << 20), 256 << 10
    with socket.create_connection(server.server_address[:2], timeout=20.0) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        got = _post(conn, body, piece, 1448, pace=50e-6)
    assert got["sha256"] == hashlib.sha256(body).hexdigest()
    segments, pieces = len(body) // 1448, len(body) // piece
    # about 5 per piece here; the sender shares this process's GIL, whose waits count too
    # (a reader woken per segment sleeps about 180 times per piece)
    assert got["sleeps"] <= min(32 * pieces, segments // 5), got
