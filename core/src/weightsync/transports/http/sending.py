"""Transport `http`: payload bytes POSTed to an endpoint the adapter names, one frame per bucket,
to every engine in parallel. For cross-cluster syncs and small deltas, where no shared disk or
group exists.

Double-buffered like `shm`: payloads are packed into `buffers` reusable send buffers (`alloc`),
and for engines that take payloads in any order (`Adapter.ordered_announces`) `send` returns as
soon as the POSTs of bucket i are on their way, so bucket i+1 is packed and sent while the engines
still stage bucket i. Engines that need payloads one after another get them that way."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, Mapping, Sequence

import requests
import torch
from pydantic import BaseModel, ConfigDict, Field

from weightsync.errors import EngineUnreachable, PayloadError, TransportError
from weightsync.net.client import Parts, call, session_for
from weightsync.interfaces import (Adapter, Payload, RelaysFetches, ServesPayloads, Transport,
                                   TransportReceiver)
from weightsync.wire.frame import frame
from weightsync.transports.http.fetch import FetchRelays
from weightsync.transports.http.relay import Relays, relay_target


class HttpOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(300.0, gt=0, description="seconds per payload request")
    retries: int = Field(1, ge=0, description="extra tries on a dropped connection")
    buffers: int = Field(2, ge=1, le=8, description="send buffers used in turn (2: the exporter "
                                                    "packs bucket i+1 while bucket i is sent)")
    shape: Literal["star", "chain", "tree"] = Field(
        "star", description="star: the trainer sends every engine its own copy; chain/tree: the "
                            "trainer sends one copy to one engine and engines pass it on, "
                            "piece by piece, each piece checked against digests the trainer "
                            "announced (engines that cannot relay still get their own copy)")
    degree: int = Field(2, ge=1, le=64, description="tree: engines each engine feeds (chain: 1)")
    piece_bytes: int = Field(256 << 10, ge=4096, le=64 << 20,
                             description="chain/tree: bytes per forwarded and checked piece")
    stall: float = Field(30.0, gt=0, description="chain/tree: seconds a member waits for its "
                                                 "relay's next piece before it gives up on it "
                                                 "(the trainer then feeds it)")
    body_host: str = Field("127.0.0.1", description="chain/tree with engines that fetch their "
                                                    "bodies: address the trainer's body "
                                                    "server binds to")
    body_advertise: str | None = Field(None, description="address those engines reach the "
                                                         "trainer's body server at (default: "
                                                         "body_host)")


class HttpReceiver(TransportReceiver):
    """The body came in the request itself (`in_band`: a server may hand the request's stream
    to `ReceiveSession.apply_stream` instead of reading the body first)."""

    in_band = True
    private = True      # the body is this process's own memory

    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        if body is None:
            raise ValueError("http transport: the payload body is missing from the request")
        if len(body) != int(header["nbytes"]):
            raise PayloadError(f"bucket {header['index']}: {len(body)} body bytes arrived, "
                               f"{header['nbytes']} were sent; the request was truncated")
        return torch.frombuffer(body, dtype=torch.uint8) if len(body) else torch.empty(0, dtype=torch.uint8)


class _Buffer:
    """One reusable send buffer and the POSTs that still read it."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.free = threading.Event()
        self.free.set()
        self.posts: list[Future] = []

    def holds(self, t: torch.Tensor) -> bool:
        b = self.tensor
        return (b is not None and t.device.type == "cpu" and b.data_ptr() <= t.data_ptr()
                and t.data_ptr() + t.numel() <= b.data_ptr() + b.numel())


class HttpTransport(Transport):
    name = "http"
    Options = HttpOptions
    requires = (ServesPayloads,)
    receiver = HttpReceiver
    spreads = True

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self._sessions: dict[tuple[str, int], requests.Session] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._ring = [_Buffer() for _ in range(self.options.buffers)]
        self._turn = 0
        self._lock = threading.Lock()
        self._pending: list[tuple[str, Future]] = []     # (engine, POST) not yet collected
        self._seq = 0
        o = self.options
        degree = 1 if o.shape == "chain" else o.degree
        self._relays = None if o.shape == "star" else Relays(degree, o.piece_bytes, o.stall)
        self._fetches = None if o.shape == "star" else \
            FetchRelays(degree, o.piece_bytes, o.stall, o.body_host, o.body_advertise, o.timeout)

    @property
    def relay_events(self) -> list[str]:
        """What the relay shapes did this round beyond the plan (fallbacks, relays blamed)."""
        if self._relays is None or self._fetches is None:
            return []
        return list(self._relays.events) + list(self._fetches.events)

    @property
    def trainer_fetches(self) -> int:
        """Bodies engines fetched from the trainer through fetch relays (roots and fallbacks)."""
        return self._fetches.trainer_fetches if self._fetches is not None else 0

    # -- buffers ----------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> torch.Tensor:
        """The next send buffer, once every POST that carried it was answered; grown if too
        small. Sender memory stays at `buffers` payloads whatever the model size."""
        with self._lock:
            buf = self._ring[self._turn]
            self._turn = (self._turn + 1) % len(self._ring)
        if not buf.free.wait(self.options.timeout):
            raise TransportError(f"no http send buffer was released within {self.options.timeout}s")
        buf.free.clear()
        buf.posts = []
        if buf.tensor is None or buf.tensor.numel() < nbytes:
            buf.tensor = None
            buf.tensor = torch.empty(max(1, nbytes), dtype=torch.uint8)
        return buf.tensor[:nbytes]

    def _buffer_of(self, body: torch.Tensor) -> _Buffer | None:
        return next((b for b in self._ring if b.holds(body)), None)

    def _release_when_done(self, buf: _Buffer | None, posts: list[Future]) -> None:
        if buf is None:
            return
        buf.posts = posts
        if not posts:
            buf.free.set()

        def one_done(_: Future) -> None:
            if all(f.done() for f in posts):
                buf.free.set()
        for f in posts:
            f.add_done_callback(one_done)

    def discard(self, payload: Payload) -> None:
        buf = self._buffer_of(payload.body)
        if buf is not None and all(f.done() for f in buf.posts):
            buf.free.set()

    # -- sending ------------------------------------------------------------------------------
    def _session(self, adapter: Adapter, lane: int) -> requests.Session:
        key = (adapter.engine_name, lane)
        with self._lock:
            if key not in self._sessions:
                self._sessions[key] = session_for(adapter.engine)
            return self._sessions[key]

    def _post(self, adapter: Adapter, payload: Payload, body: torch.Tensor, lane: int) -> None:
        if not isinstance(adapter, ServesPayloads):
            raise TransportError(f"adapter {adapter.name!r} has no HTTP payload endpoint")
        ep = adapter.payload_endpoint()
        header = payload.header()
        parts, ctype = (ep.render(header, body) if ep.render is not None
                        else (frame(header, body), "application/octet-stream"))
        for attempt in range(self.options.retries + 1):
            try:
                call(self._session(adapter, lane), adapter.engine_name, "POST", ep.url,
                     timeout=self.bounded(min(ep.timeout, self.options.timeout)), data=Parts(parts),
                     headers={**ep.headers, "Content-Type": ctype})
                return
            except Exception as e:
                # only a connection that failed before any answer: a timeout may have been
                # taken (the engine may still be reading the body), so it is never sent twice
                if not isinstance(e, EngineUnreachable) or attempt == self.options.retries:
                    raise

    def _left(self) -> float:
        """What a relayed bucket may still take: the per-request timeout, cut to the deadline."""
        return self.bounded(self.options.timeout)

    def _relay_post(self, adapter: Adapter, kwargs: dict[str, Any], timeout: float) -> Any:
        """The root's POST (no API key: its relay token), answered with a status either way."""
        return self._session(adapter, 2).post(timeout=min(timeout, self.options.timeout), **kwargs)

    def open(self, engines: Sequence[Adapter], version: int) -> dict[str, BaseException]:
        self._collect(wait=True)
        if self._relays is not None and self._fetches is not None:
            self._relays.open()
            self._fetches.open()
        with self._lock:
            self._turn = 0
            for b in self._ring:         # a payload allocated by an aborted sync was never sent
                if all(f.done() for f in b.posts):
                    b.posts = []
                    b.free.set()
        return {}

    def _collect(self, wait: bool, keep: int = 0) -> dict[str, BaseException]:
        """Failures of the POSTs sent before the last `keep` payloads (waiting for them)."""
        with self._lock:
            cut = max(0, len(self._pending) - keep)
            done, self._pending = self._pending[:cut], self._pending[cut:]
        failures: dict[str, BaseException] = {}
        for name, f in done:
            err = f.exception() if wait or f.done() else None
            if err is not None:
                failures.setdefault(name or "relay", err)
            elif not name and (wait or f.done()):      # a relayed bucket: its failures by name
                for n, e in f.result().items():
                    failures.setdefault(n, e)
        return failures

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        body = payload.body
        if body.device.type != "cpu":
            body = body.cpu()
        buf = self._buffer_of(body)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(8, 4 * len(engines)),
                                            thread_name_prefix="ws-http")
        self._seq += 1
        lane = self._seq % 2
        relayed = [a for a in engines if relay_target(a) is not None] if self._relays else []
        if len(relayed) < 2:
            relayed = []
        pulled = [a for a in engines if a not in relayed and _fetches(a)] if self._fetches else []
        if len(pulled) < 2:
            pulled = []
        star = [a for a in engines if a not in relayed and a not in pulled]
        posts = {a.engine_name: self._pool.submit(self._post, a, payload, body, lane) for a in star}
        jobs = [self._pool.submit(self._relays.push, payload, body, relayed, self._relay_post,
                                  lambda a: self._post(a, payload, body, lane), self._left)
                ] if relayed and self._relays is not None else []
        if pulled and self._fetches is not None:
            jobs.append(self._pool.submit(self._fetches.push, payload, body, pulled, self._left))
        self._release_when_done(buf, list(posts.values()) + jobs)
        with self._lock:
            self._pending += [(n, posts[n]) for n in posts] + [("", j) for j in jobs]
        # engines that take payloads in any order keep this one in flight while the next is
        # packed and sent; the others (and a body not in our buffers) get it answered first
        overlap = buf is not None and all(a.ordered_announces for a in engines)
        previous = len(posts) + len(jobs) if overlap else 0
        return self._collect(wait=True, keep=previous)

    def finish(self, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        return self._collect(wait=True)

    def relay_plan(self, engines: Sequence[Adapter]) -> dict[str, list[str]] | None:
        """The tree `send` would build over `engines` (star: None)."""
        if self._relays is None:
            return None
        names = [a.engine_name for a in engines if relay_target(a) is not None]
        return self._relays.plan(names) if len(names) >= 2 else {}

    def remarks(self) -> dict[str, str]:
        """Relays planned as leaves this push, and why."""
        if self._relays is None or self._fetches is None:
            return {}
        return {**self._fetches.strikes.remarks(), **self._relays.strikes.remarks()}

    def close(self) -> None:
        self._collect(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._relays is not None:
            self._relays.close()
        if self._fetches is not None:
            self._fetches.close()
        for s in self._sessions.values():
            s.close()
        self._sessions.clear()


def _fetches(a: Adapter) -> bool:
    """Whether the engine can take part in fetch relays (one that cannot be asked takes star)."""
    try:
        return isinstance(a, RelaysFetches) and a.relay_source() is not None
    except Exception:  # noqa: BLE001 - its own send reports why
        return False
