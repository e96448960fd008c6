"""Calls to engines that can be taken back: a generation whose caller went away, or whose engine
stopped answering, is cancelled by shutting the connection it runs on. The engine sees its
caller hang up and stops generating for it (the reference engine at its next token, vLLM's
completions route by its own cancellation), and the thread that waited is released at once.

A `Scope` collects the connections its thread takes from the pool while it is active; the
session of each engine adapter is given `CancellableAdapter`, whose pools report every
connection they hand out to the active scope of the calling thread."""

from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import requests
from requests.adapters import HTTPAdapter
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

__all__ = ["CancellableAdapter", "Scope", "mount"]

_active = threading.local()


class Scope:
    """The connections of one call; `cancel(why)` shuts them (the call then fails at once) and
    keeps `why` so the caller can tell a cancellation from an engine's fault."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conns: list[Any] = []
        self.why: str | None = None

    def add(self, conn: Any) -> None:
        with self.lock:
            self.conns.append(conn)
            why = self.why
        if why is not None:                  # cancelled before its connection was taken
            _shut(conn)

    def cancel(self, why: str) -> None:
        with self.lock:
            if self.why is not None:
                return
            self.why = why
            conns = list(self.conns)
        for c in conns:
            _shut(c)

    def close(self) -> None:
        """The call ended: its connections went back to the pool, and a later `cancel` must
        not reach them (another call may be using one)."""
        with self.lock:
            if self.why is None:
                self.why = "done"
            self.conns.clear()

    @contextmanager
    def active(self) -> Iterator["Scope"]:
        """Connections this thread takes inside the block belong to this scope."""
        before = getattr(_active, "scope", None)
        _active.scope = self
        try:
            yield self
        finally:
            _active.scope = before


def _shut(conn: Any) -> None:
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _Reporting:
    """Mixed into urllib3's pools: each connection handed out joins the thread's scope."""

    def _get_conn(self, timeout: float | None = None) -> Any:
        conn = super()._get_conn(timeout)  # type: ignore[misc]
        scope = getattr(_active, "scope", None)
        if scope is not None:
            scope.add(conn)
        return conn


class _Pool(_Reporting, HTTPConnectionPool):
    pass


class _TLSPool(_Reporting, HTTPSConnectionPool):
    pass


class CancellableAdapter(HTTPAdapter):
    """requests' adapter with pools that report their connections to the calling scope."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _Pool, "https": _TLSPool}


def mount(session: requests.Session) -> None:
    """Calls through `session` become cancellable by a `Scope`."""
    adapter = CancellableAdapter()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
