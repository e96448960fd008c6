"""One request body as a stream for the HTTP server's handlers (`Handler.body_reader`): reads
never pass its Content-Length, and a body on a paced link can be read in gathered receives."""

from __future__ import annotations

import io
import socket
from typing import Any

# what a handler's rfile may hold ahead of a read (`socket.makefile` buffers this much)
_RFILE_BUFFER = io.DEFAULT_BUFFER_SIZE


class BodyStream:
    """`read_into(view)` over one request body, keeping the handler's count of unread bytes
    current. `gather` (bytes, 0: off): each read waits until that many bytes arrived
    (SO_RCVLOWAT), so a body on a paced link does not wake its reader every few packets."""

    def __init__(self, handler: Any, n: int, gather: int = 0) -> None:
        self.handler, self.left = handler, n
        handler._length = n
        # not over TLS (records, and buffers of its own), and only where one receive is a call
        plain = type(handler.connection) is socket.socket and hasattr(handler.rfile, "readinto1")
        self.gather, self._lowat = (gather if plain else 0), 1

    def _low_water(self, n: int) -> None:
        if n != self._lowat:
            try:
                self.handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
                self._lowat = n
            except OSError:
                self.gather = 0

    def __call__(self, view: memoryview) -> int:
        if self.left <= 0:
            return 0
        view = view[: self.left]
        if not self.gather:
            k = self.handler.rfile.readinto(view) or 0
        else:
            # one receive after what rfile holds (at most its buffer), woken once `want` bytes
            # are in: this very read needs that many more, so they come whatever follows
            want = min(self.gather, len(view) - _RFILE_BUFFER)
            try:
                self._low_water(want if want >= 4096 else 1)
                k = self.handler.rfile.readinto1(view) or 0
            except BaseException:
                self._low_water(1)
                raise
            if k >= self.left:
                self._low_water(1)       # the connection's next request may be a few bytes
        self.left -= k
        self.handler._length = self.left
        return k
