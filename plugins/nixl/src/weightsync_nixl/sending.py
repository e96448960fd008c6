"""The trainer's half of transport `nixl`: payloads are written straight into send buffers
registered with NIXL once (`alloc`, used in turn), and each engine is told where they are with a
`nixl.read` message: the agent's metadata and the buffer's descriptors, as JSON. The engine READs
one-sided; a buffer is handed out again only when every engine answered and NIXL's notification
says its READ is complete (an engine that failed releases nothing it could still be reading
into: its round is dropped, and digests decide what any engine commits)."""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from weightsync.errors import TransportError
from weightsync.interfaces import Adapter, Payload, Transport
from weightsync_nixl.agent import Region, agent
from weightsync_nixl.messages import NixlRead, b64
from weightsync_nixl.receiving import NixlReceiver

log = logging.getLogger("weightsync_nixl")
NOTIF_GRACE = 10.0               # seconds a notification may trail the engine's answer


class NixlOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    buffers: int = Field(2, ge=1, le=8, description="send buffers used in turn (2: one is read "
                                                    "while the next bucket is packed)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where send buffers live: cpu (DRAM) or cuda (VRAM, GPUDirect on a "
                            "fabric that has it); auto: cuda when available")
    staging_device: Literal["cpu", "cuda"] = Field(
        "cpu", description="engine side: where payloads are read into before staging")
    timeout: float = Field(600.0, gt=0, description="seconds one READ may take; the push's "
                                                    "deadline cuts it")
    stall: float = Field(60.0, gt=0, description=(
        "seconds a send buffer waits for engines still reading it; then they are dropped from "
        "the sync (their digests would fail if they read on) and the others go on"))
    max_bucket_bytes: int = Field(2**34, gt=0, description="engine side: the largest payload "
                                                           "an engine reads")


@dataclass
class _Buffer:
    index: int
    region: Region | None = None
    generation: int = 0
    free: threading.Event = field(default_factory=threading.Event)
    readers: dict[str, Future] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free.set()

    def contains(self, t: torch.Tensor) -> bool:
        if self.region is None or t.device != self.region.tensor.device:
            return False
        base = self.region.tensor.data_ptr()
        return base <= t.data_ptr() and t.data_ptr() + t.numel() <= base + self.region.tensor.numel()


class NixlTransport(Transport):
    name = "nixl"
    Options = NixlOptions
    messages = (NixlRead,)
    receiver = NixlReceiver
    spreads = True      # each rank reads from its own agent and buffers (`sync.senders: all`)

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        o = self.options
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if o.device == "auto" else o.device
        self.token = secrets.token_hex(4)
        self.bufs = [_Buffer(i) for i in range(o.buffers)]
        self.turn = 0
        self.lock = threading.Lock()
        self.errors: dict[str, BaseException] = {}
        self._pool: ThreadPoolExecutor | None = None

    # -- buffers --------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> torch.Tensor:
        """The next send buffer in turn, once every engine's READ of it completed; grown (and
        registered again) when too small."""
        with self.lock:
            buf = self.bufs[self.turn]
            self.turn = (self.turn + 1) % len(self.bufs)
        if not buf.free.wait(self.bounded(self.options.stall)):
            self._drop_slow(buf)
        buf.free.clear()
        buf.readers = {}
        if buf.region is None or buf.region.tensor.numel() < nbytes:
            me = agent("trainer")
            if buf.region is not None:
                me.deregister(buf.region)
            buf.region = me.register(torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device))
        buf.generation += 1
        return buf.region.tensor[:nbytes]

    def _drop_slow(self, buf: _Buffer) -> None:
        """Engines still reading `buf` after `stall` seconds fail this sync; the buffer is reused
        (an engine that reads on gets other bytes, and its digest refuses them)."""
        slow = sorted(n for n, f in buf.readers.items() if not f.done())
        log.warning("nixl: engines %s did not finish reading send buffer %d within %gs; dropped "
                    "from this sync", slow, buf.index, self.options.stall)
        with self.lock:
            for n in slow:
                self.errors.setdefault(n, TransportError(
                    f"engine {n} did not finish its NIXL READ of send buffer {buf.index} within "
                    f"{self.options.stall:g}s (transport option 'stall'); dropped from this sync"))

    def _buffer_of(self, body: torch.Tensor) -> _Buffer | None:
        return next((b for b in self.bufs if b.contains(body)), None)

    # -- sync -----------------------------------------------------------------------------------
    def open(self, engines: Sequence[Adapter], version: int) -> dict[str, BaseException]:
        """Every buffer is free again: the last sync's readers finished, or failed (a stalled
        engine that reads on gets other bytes, and its digest refuses them)."""
        with self.lock:
            self.turn = 0
            for b in self.bufs:
                b.generation += 1          # callbacks of the last sync no longer free it
                b.readers = {}
                b.free.set()
            self.errors.clear()
        agent("trainer").drop_notes()
        return {}

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        body = payload.body
        buf = self._buffer_of(body)
        if buf is None:                     # the encoding did not write into our buffer
            dst = self.alloc(body.numel())
            dst.copy_(body)
            body, buf = dst, self._buffer_of(dst)
            assert buf is not None
        if body.is_cuda:
            torch.cuda.current_stream(body.device).synchronize()
        assert buf.region is not None
        me = agent("trainer")
        offset = body.data_ptr() - buf.region.tensor.data_ptr()
        common = {"header": payload.header(), "agent": me.name, "metadata": b64(me.metadata()),
                  "mem": buf.region.mem, "descs": [list(d) for d in buf.region.descs(offset, body.numel())]
                  if body.numel() else []}
        with self.lock:
            failed = dict(self.errors)
        targets = [a for a in engines if a.engine_name not in failed]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(targets)),
                                            thread_name_prefix="ws-nixl")
        futures = {a.engine_name: self._pool.submit(self._read, a, common, buf, payload.index)
                   for a in targets}
        buf.readers = futures
        left = [len(futures)]
        lock = threading.Lock()
        generation = buf.generation

        def done(_: Future) -> None:           # a dropped reader must not free a reused buffer
            with lock:
                left[0] -= 1
                if left[0] == 0 and buf.generation == generation:
                    buf.free.set()
        if not futures:
            buf.free.set()
        for f in futures.values():
            f.add_done_callback(done)
        return failed

    def _read(self, adapter: Adapter, common: dict[str, Any], buf: _Buffer, index: int) -> None:
        """One engine's READ of one payload: the message, then NIXL's completion notification."""
        who = hashlib.sha256(adapter.engine_name.encode()).hexdigest()[:16]
        notif = f"ws:{self.token}:{buf.index}:{buf.generation}:{who}"
        wait = self.bounded(self.options.timeout)
        try:
            with agent("trainer").busy():    # the engine's READ needs this side to progress
                adapter.deliver(NixlRead({**common, "notif": notif, "deadline": wait}, wait=wait + 5.0))
                if common["descs"] and agent("trainer").wait_notif(
                        notif.encode(), time.monotonic() + min(NOTIF_GRACE, wait)) is None:
                    raise TransportError(f"engine {adapter.engine_name} answered bucket {index}, but "
                                         f"NIXL's notification that its READ completed never came")
        except BaseException as e:  # noqa: BLE001 - reported by send/finish for this engine
            with self.lock:
                self.errors.setdefault(adapter.engine_name, e)

    def discard(self, payload: Payload) -> None:
        buf = self._buffer_of(payload.body)
        if buf is not None and all(f.done() for f in buf.readers.values()):
            buf.free.set()

    def _wait_all(self, timeout: float) -> bool:
        """Until every engine not already failed finished its READs (False: not by `timeout`)."""
        with self.lock:
            failed = set(self.errors)
        pending = [f for b in self.bufs for n, f in b.readers.items() if n not in failed]
        return not wait(pending, timeout).not_done

    def finish(self, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        ok = self._wait_all(self.bounded(self.options.timeout))
        with self.lock:
            fails = dict(self.errors)
        if not ok:
            for b in self.bufs:
                for n, f in b.readers.items():
                    if not f.done() and n not in fails:
                        fails.setdefault(n, TransportError(
                            f"engine did not finish its NIXL READ of send buffer {b.index} by the "
                            f"deadline"))
        return fails

    def close(self) -> None:
        self._wait_all(min(self.options.timeout, 30.0))
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        for b in self.bufs:
            if b.region is not None and all(f.done() for f in b.readers.values()):
                agent("trainer").deregister(b.region)
                b.region = None
