"""Shedding slow and hostile clients before they hold a service (`weightsync.net.server`). A
client that has not shown a key is *unproven*: its head bytes are capped (`HeadReader`), its head
has an absolute deadline, and a new connection beyond `max_heads` unproven heads closes the oldest
(only slow clients grow old). A connection that passed the key check (or, without a key, got an
answer) is *proven*: it waits for its next request under the idle timeout and is never evicted."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from typing import Any


class HeadReader:
    """A connection's rfile that counts the bytes of each request head against a cap."""

    def __init__(self, raw: Any, cap: int) -> None:
        self.raw, self.cap, self.left, self.limited = raw, cap, cap, False

    def start_head(self) -> None:
        self.left, self.limited = self.cap, True

    def end_head(self) -> None:
        self.limited = False

    def readline(self, limit: int = -1) -> bytes:
        if self.limited:
            limit = min(self.left + 1, limit if limit >= 0 else self.left + 1)
        line = self.raw.readline(limit)
        if self.limited:
            self.left -= len(line)
            if self.left < 0:
                raise http.client.LineTooLong(f"request head over {self.cap} bytes")
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class HeadGuard:
    """The unproven heads being read, oldest first; evicts and reaps them (see module doc)."""

    def __init__(self, max_heads: int, deadline: float) -> None:
        self.max_heads, self.deadline = max_heads, deadline
        self.heads: dict[Any, float] = {}        # handler -> its head's deadline (insertion: age)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._reap, name="ws-head-reaper", daemon=True)
        self.thread.start()

    def started(self, handler: Any) -> None:
        if getattr(handler, "proven", False):
            return
        with self.lock:
            while len(self.heads) >= self.max_heads:
                old = next(iter(self.heads))
                del self.heads[old]
                self._drop(old)
            self.heads[handler] = time.monotonic() + self.deadline

    def ended(self, handler: Any) -> None:
        with self.lock:
            self.heads.pop(handler, None)

    def _drop(self, handler: Any) -> None:
        """Close the connection under the handler's blocked read: it sees the end and leaves."""
        handler.dropped = True                   # a head cut short is never dispatched
        with contextlib.suppress(OSError):
            handler.connection.shutdown(socket.SHUT_RDWR)

    def _reap(self) -> None:
        while not self.stop.wait(min(0.25, self.deadline / 4)):
            now = time.monotonic()
            with self.lock:
                late = [h for h, d in self.heads.items() if d < now]
                for h in late:
                    del self.heads[h]
                    self._drop(h)

    def close(self) -> None:
        self.stop.set()
