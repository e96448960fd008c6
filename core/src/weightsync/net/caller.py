"""Whether the caller of a request still waits for its answer: a long request (a generation)
stops for a caller that hung up, instead of computing an answer no one will read."""

from __future__ import annotations

import select
import socket

__all__ = ["hung_up"]


def hung_up(sock: socket.socket) -> bool:
    """True once the peer of `sock` closed it (after the body was read, a readable socket that
    yields no byte is the caller's end); never blocks. On TLS the peek sees the TCP stream."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        flags = socket.MSG_PEEK | socket.MSG_DONTWAIT
        return bool(readable) and socket.socket.recv(sock, 1, flags) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True
