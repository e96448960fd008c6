"""The data path of a round: bucket i+1 is exported and encoded on a worker thread while bucket i is
sent; at most `max_inflight` payloads exist, and one never sent gives its buffer back."""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any, Callable

import torch

from weightsync.interfaces import Adapter, Encoding, Exporter, NameMap, Payload, Transport
from weightsync.sync.report import SyncReport
from weightsync.wire.signing import sign

_DONE = object()


def model_bytes(model: Any) -> int | None:
    """The bytes of a module's or a state dict's tensors (a progress bar's total); entries that
    are not tensors (Megatron's `_extra_state`) count nothing."""
    values = (model.state_dict().values() if isinstance(model, torch.nn.Module)
              else model.values() if isinstance(model, dict) else None)
    if values is None:
        return None
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor))


class Progress:
    """A rich progress bar when interactive (or asked for), silent otherwise."""

    def __init__(self, setting: str, total: int | None, version: int) -> None:
        self.bar = None
        if setting == "on" or (setting == "auto" and sys.stderr.isatty()):
            from rich.progress import BarColumn, DownloadColumn, Progress as Bar, TransferSpeedColumn
            self.bar = Bar("[progress.description]{task.description}", BarColumn(),
                           DownloadColumn(), TransferSpeedColumn(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(f"sync v{version}", total=total)

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class Stream:
    """Runs the export -> encode -> send loop for one round."""

    def _late(self, grace: float = 0.0) -> bool:
        """Past the transport's sending deadline (plus `grace` seconds)."""
        end = self.transport.deadline
        return end is not None and time.monotonic() > end + grace

    def _next(self, q: queue.Queue) -> Any:
        """The next item of the export, waited for no later than the sending deadline: an export
        stuck in a collective (a trainer rank frozen) fails the round instead of hanging it."""
        while True:
            end = self.transport.deadline
            try:
                return q.get(timeout=None if end is None else max(0.05, end - time.monotonic()))
            except queue.Empty:
                if self._late():
                    raise TimeoutError("the export made no bucket before the push's deadline "
                                       "(a trainer rank stuck in a collective?)") from None

    def __init__(self, exporter: Exporter, encoding: Encoding, transport: Transport,
                 max_inflight: int, progress: str, timed: Callable[[str], Any],
                 key: bytes | None = None, on_pass: Callable[[], None] | None = None,
                 spread: bool = False) -> None:
        self.exporter, self.encoding, self.transport = exporter, encoding, transport
        self.spread = spread        # senders: all: this rank's own buckets, and every one of them
        self.max_inflight, self.progress, self.timed = max_inflight, progress, timed
        self.key = key
        self.on_pass = on_pass or (lambda: None)   # counts exporter passes (multi-rank trainers)
        self.names: dict[int, list[str]] = {}       # each bucket's tensors (peer joins' anchor)
        self.changed = self.elements = 0            # delta encodings: of this stream's buckets

    def run(self, model: Any, name_map: NameMap | None, report: SyncReport, active: list[Adapter],
            drop: Callable[[list[Adapter], dict[str, BaseException], str], list[Adapter]],
            digests: dict[int, str], *, mode: str = "engines", count: bool = True) -> list[Adapter]:
        """Stream every bucket to `active`; returns the engines still in. `mode` "publish": no
        engine; "encode": encoded and dropped (the encoding's state must advance); "engines":
        stops once none is left. `count` False reports only wire bytes (a catch-up pass)."""
        timed = self.timed
        slots = threading.Semaphore(self.max_inflight)
        q: queue.Queue = queue.Queue()
        stop = threading.Event()
        bar = Progress(self.progress, model_bytes(model), report.version)
        self.on_pass()      # counted only now: a failure before it leaves the pass to be drained
        alloc = self.transport.alloc
        ahead = self.transport.announce_ahead       # collective: announce on packing
        changed = elements = sent = 0

        def produce() -> None:
            it = None
            try:
                export = self.exporter.owned if self.spread else self.exporter.buckets
                it = export(model, name_map=name_map)
                while not stop.is_set():
                    slots.acquire()
                    with timed("export"):
                        bucket = next(it, None)
                    if bucket is None or stop.is_set():
                        break
                    with timed("encode"):
                        payload = self.encoding.encode(bucket, alloc)
                        if self.key is not None:
                            payload.sig = sign(self.key, report.version, payload.header())
                    if ahead is not None and mode == "engines" and active:
                        ahead(payload, active)      # engines post their receive meanwhile
                    q.put(payload)
                    del bucket, payload
            except BaseException as e:  # noqa: BLE001 - handed to the sending thread
                q.put(e)
                return
            finally:
                if it is not None and hasattr(it, "close"):
                    it.close()          # an exporter stopped early still serves other ranks
            q.put(_DONE)

        worker = threading.Thread(target=produce, name="ws-export", daemon=True)
        worker.start()
        try:
            while True:
                item = self._next(q)
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                payload: Payload = item
                sent += 1
                report.wire_bytes += payload.wire_bytes
                digests[payload.index] = payload.digest
                self.names[payload.index] = [spec.name for spec in payload.specs]
                if count:
                    report.buckets += 1
                    report.tensors += len(payload.specs)
                    report.logical_bytes += payload.logical_bytes
                    if "changed_elements" in payload.meta:   # delta encodings: how sparse
                        changed += int(payload.meta["changed_elements"])
                        elements += sum(s.numel for s in payload.specs)
                        report.density = changed / max(1, elements)
                if mode == "publish":
                    with timed("send"):
                        self.transport.send(payload, [])
                elif active:
                    for a in active:
                        a.observe(payload)
                    with timed("send"):
                        fails = self.transport.send(payload, active)
                    active = drop(active, fails, "send")
                else:
                    self.transport.discard(payload)
                    if mode == "engines" and not self.spread:   # every engine failed: stop
                        break       # (a rank of a spread push exports on: its groups' gathers)
                bar.advance(payload.logical_bytes)
                del payload, item
                slots.release()
            if sent == 0 and not self.spread:
                raise ValueError("the model has no tensors to send")
        finally:
            stop.set()
            slots.release()
            while worker.is_alive() or not q.empty():   # payloads never sent give their buffers back
                try:
                    left = q.get(timeout=0.05)
                except queue.Empty:
                    if self._late(5.0):
                        break       # the export is stuck (in a collective): left behind
                    continue
                if isinstance(left, Payload):
                    self.transport.discard(left)
                slots.release()
            worker.join(timeout=0.1 if self._late(5.0) else None)
            bar.close()
            self.changed, self.elements = changed, elements
        return active
