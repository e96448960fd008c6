"""The relay floor: how fast the emulated cluster itself can pass one copy down a chain of N
hosts, with no weightsync in the way. A plain TCP forwarder on every member host reads the copy
in `piece`-byte reads and writes each read on to the next host at once (no checks, no staging,
no HTTP); the last host discards it and an acknowledgement travels back up the chain. Whatever
a relay shape costs above this is weightsync's; whatever this costs above one copy over one
link is the cluster's (shaped links, the bridge, and every host sharing this machine's cores).

`worker.py` runs it before the engines start, for every N of the bench, with the pieces the
relay shapes use."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from typing import Any, Callable

FLOOR_PORT = 9700
# a forwarder: each message is (length, hops left, piece bytes, next host), the hosts after the
# next one (4 bytes each, hops - 2 of them) and `length` bytes;
# with hops left it forwards each read to the next host's forwarder, then waits for its ack;
# then it acknowledges upstream with one byte
FORWARDER = """
import socket, struct, sys, threading
PORT = int(sys.argv[2])
def serve(c):
    while True:
        head = c.recv(24, socket.MSG_WAITALL)
        if len(head) < 24:
            return c.close()
        left, hops, piece, nxt = struct.unpack("!QIIQ", head)
        view = memoryview(bytearray(piece))
        down = None
        if hops > 1:
            down = socket.create_connection((socket.inet_ntoa(struct.pack("!I", nxt & 0xffffffff)), PORT))
            down.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hosts = c.recv((hops - 2) * 4, socket.MSG_WAITALL) if hops > 2 else b""
            after = struct.unpack("!I", hosts[:4])[0] if hops > 2 else 0
            down.sendall(struct.pack("!QIIQ", left, hops - 1, piece, after) + hosts[4:])
        while left:
            got = c.recv_into(view, min(left, piece))
            if not got:
                return c.close()
            if down is not None:
                down.sendall(view[:got])
            left -= got
        if down is not None:
            if down.recv(1) != b"k":
                return c.close()
            down.close()
        c.sendall(b"k")
srv = socket.create_server((sys.argv[1], PORT))
while True:
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def _ip(a: str) -> int:
    return struct.unpack("!I", socket.inet_aton(a))[0]


def chain_seconds(addrs: list[str], body: memoryview, piece: int,
                  connect: Callable[[str, int], socket.socket]) -> float:
    """Seconds until one copy of `body` passed through the forwarders at `addrs`, in order, and
    the last one's acknowledgement came back."""
    s = connect(addrs[0], FLOOR_PORT)
    try:
        rest = b"".join(struct.pack("!I", _ip(a)) for a in addrs[2:])
        t0 = time.perf_counter()
        nxt = _ip(addrs[1]) if len(addrs) > 1 else 0
        s.sendall(struct.pack("!QIIQ", len(body), len(addrs), piece, nxt) + rest)
        s.sendall(body)
        if s.recv(1) != b"k":
            raise RuntimeError("a relay floor forwarder closed before acknowledging")
        return time.perf_counter() - t0
    finally:
        s.close()


def relay_floor(hosts: list[str], addr: Callable[[str], str], in_ns: Callable[[str], list[str]],
                body: memoryview, members: list[int], piece: int, repeat: int,
                connect: Callable[[str, int], socket.socket]) -> list[dict[str, Any]]:
    """Best of `repeat` (after a warm-up) chain seconds through the first N of `hosts`, per N."""
    procs = [subprocess.Popen(in_ns(h) + [sys.executable, "-c", FORWARDER, addr(h),
                                          str(FLOOR_PORT)]) for h in hosts]
    try:
        rows = []
        for n in members:
            chain = [addr(h) for h in hosts[:n]]
            runs = [chain_seconds(chain, body, piece, connect) for _ in range(repeat + 1)][1:]
            rows.append({"members": n, "piece_bytes": piece, "seconds": min(runs), "runs": runs})
            print(f"[trainer] relay floor N={n:<3} {min(runs):7.3f} s  runs "
                  f"{[round(x, 3) for x in runs]}", flush=True)
        return rows
    finally:
        for p in procs:
            p.kill()
            p.wait()
