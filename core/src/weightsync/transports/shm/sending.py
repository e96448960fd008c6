"""The trainer's half of transport `shm`: shared buffers used in turn, announces, releases."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from weightsync.errors import TransportError
from weightsync.interfaces import Adapter, Announce, Payload, Transport
from weightsync.transports.shm.receiving import ShmReceiver
from weightsync.transports.shm.segments import (GEN_BYTES, PREFIX, Segment, create_cpu_segment)

log = logging.getLogger("weightsync.transports.shm")


class ShmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    segments: int = Field(2, ge=1, le=8, description="buffers used in turn (2 = double-buffered)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cpu: POSIX shared memory; cuda: CUDA IPC; auto: cuda when available")
    timeout: float = Field(600.0, gt=0, description="seconds alloc waits for a buffer to be released")
    keep_segments: bool = Field(True, description="keep buffers between syncs (false: unlink at "
                                                  "the end of every sync)")


class ShmTransport(Transport):
    name = "shm"
    Options = ShmOptions
    messages = (Announce,)
    same_host = True
    receiver = ShmReceiver

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        o = self.options
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if o.device == "auto" else o.device
        self.token = secrets.token_hex(4)
        self.created = 0
        self.segs = [Segment(i) for i in range(o.segments)]
        self.turn = 0
        self.lock = threading.Lock()
        self.errors: dict[str, BaseException] = {}
        self._pool: ThreadPoolExecutor | None = None

    # -- buffers ----------------------------------------------------------------------------
    def _grow(self, seg: Segment, nbytes: int) -> None:
        seg.drop()
        size = max(nbytes, 1)
        if self.device == "cuda":
            from weightsync.transports.shm.cuda_ipc import export_buffer
            seg.tensor = torch.empty(size, dtype=torch.uint8, device="cuda")
            seg.ipc = export_buffer(seg.tensor)
        else:
            self.created += 1
            seg.name = f"{PREFIX}{os.getpid()}-{self.token}-{self.created}"
            seg.mm, seg.tensor = create_cpu_segment(seg.name, size + GEN_BYTES)
        seg.size = size

    def _bump(self, seg: Segment) -> None:
        """A new generation of `seg`, written before anything of the next payload is."""
        seg.generation += 1
        if seg.tensor is not None and seg.ipc is None:
            tail = seg.tensor[seg.size: seg.size + 8]
            tail.copy_(torch.frombuffer(bytearray(seg.generation.to_bytes(8, "little")), dtype=torch.uint8))

    def alloc(self, nbytes: int) -> torch.Tensor:
        """The next buffer in turn, once every engine released it; grown if too small."""
        with self.lock:
            seg = self.segs[self.turn]
            self.turn = (self.turn + 1) % len(self.segs)
        if not seg.free.wait(self.options.timeout):
            busy = sorted(n for n, f in seg.readers.items() if not f.done())
            raise TransportError(f"shm buffer {seg.index} is still being read by {busy} after "
                                 f"{self.options.timeout}s; raise transport option 'timeout' or "
                                 f"check those engines")
        seg.free.clear()             # taken: filled now, released when its announces return
        seg.readers = {}
        if seg.size < nbytes:
            self._grow(seg, nbytes)
        self._bump(seg)
        assert seg.tensor is not None            # grown above, or held from an earlier payload
        return seg.tensor[:nbytes]

    def _segment_of(self, body: torch.Tensor) -> Segment | None:
        return next((s for s in self.segs if s.contains(body)), None)

    # -- sync ---------------------------------------------------------------------------------
    def open(self, engines: Sequence[Adapter], version: int) -> dict[str, BaseException]:
        self._wait_all(self.options.timeout)
        with self.lock:
            self.turn = 0
            for s in self.segs:          # a payload allocated by an aborted sync was never sent
                if all(f.done() for f in s.readers.values()):
                    s.readers.clear()
                    s.free.set()
        self.errors.clear()
        return {}

    def _announce(self, seg: Segment, adapter: Adapter, header: dict[str, Any]) -> None:
        try:
            adapter.deliver(Announce(header))
        except BaseException as e:  # noqa: BLE001 - reported by send/finish for this engine
            with self.lock:
                self.errors.setdefault(adapter.engine_name, e)

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        body = payload.body
        seg = self._segment_of(body)
        if seg is None:               # the encoding did not write into our buffer: copy it in
            dst = self.alloc(body.numel())
            dst.copy_(body)
            body = dst
            seg = self._segment_of(body)
            assert seg is not None
        if body.is_cuda:
            torch.cuda.current_stream(body.device).synchronize()   # bytes visible to readers
        assert seg.tensor is not None            # it contains body
        offset = body.data_ptr() - seg.tensor.data_ptr()
        fields: dict[str, Any] = {"offset": offset, "nbytes": body.numel(), "device": body.device.type}
        if seg.ipc is not None:
            fields["cuda_ipc"] = seg.ipc
        else:
            fields["segment"] = seg.name
            fields["generation"] = seg.generation
        header = payload.header(**fields)
        with self.lock:
            failed = dict(self.errors)
        targets = [a for a in engines if a.engine_name not in failed]
        if self._pool is None:       # announce threads kept from bucket to bucket
            self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(targets)),
                                            thread_name_prefix="ws-shm")
        reads = [self._pool.submit(self._announce, seg, a, header) for a in targets]
        seg.readers = {a.engine_name: f for a, f in zip(targets, reads)}

        def read(_: Future) -> None:       # the buffer is free once every engine staged it
            if all(f.done() for f in reads):
                seg.free.set()
        if not reads:
            seg.free.set()
        for f in reads:
            f.add_done_callback(read)
        return failed

    def discard(self, payload: Payload) -> None:
        seg = self._segment_of(payload.body)
        if seg is not None and all(f.done() for f in seg.readers.values()):
            seg.free.set()

    def _wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for s in self.segs:
            if (not s.free.is_set() and s.readers
                    and not s.free.wait(max(0.0, deadline - time.monotonic()))):
                return False
        return True

    def finish(self, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        ok = self._wait_all(self.options.timeout)
        with self.lock:
            fails = dict(self.errors)
        if not ok:
            for s in self.segs:
                for n, f in s.readers.items():
                    if not f.done():
                        fails.setdefault(n, TransportError(
                            f"engine did not finish reading shm buffer {s.index} within "
                            f"{self.options.timeout}s"))
        if not self.options.keep_segments:
            for s in self.segs:
                if s.free.is_set():
                    s.drop()
        return fails

    def close(self) -> None:
        self._wait_all(min(self.options.timeout, 30.0))
        for s in self.segs:
            s.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def segment_names(self) -> list[str]:
        return [s.name for s in self.segs if s.name]
