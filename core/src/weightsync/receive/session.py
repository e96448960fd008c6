"""`ReceiveSession`: one update round inside an engine (begin -> apply* -> end -> commit |
abort), staging every bucket and applying nothing until commit."""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

import torch

from weightsync.wire.bucket import combine_digests, digest_algo
from weightsync.errors import PayloadError
from weightsync.interfaces import Payload, TransportReceiver
from weightsync.wire.signing import check as check_signature
from weightsync.receive.staging import (BodyReader, build_encoding, build_receiver, check_digest,
                                        decode_checked, payload_nbytes, read_exact, read_staged,
                                        round_digests, stage_from, unique_names)
from weightsync.receive.stores import WeightStore, check_tensor


class ReceiveSession:
    """One update round inside an engine: begin -> apply* -> end -> commit | abort."""

    def __init__(self, store: WeightStore, plan: Mapping[str, Any], components: Any,
                 key: bytes | None = None) -> None:
        self.store = store
        self.key = key                 # HMAC key: payloads must be signed (weightsync.wire.signing)
        self.version = int(plan["version"])
        self.encoding = build_encoding(plan["encoding"], components)
        if plan.get("engine_version") is not None:
            self.encoding.receiving(int(plan["engine_version"]))
        self.rx: TransportReceiver = build_receiver(plan["transport"], components)
        self.staged: dict[str, torch.Tensor] = {}
        self.digests: dict[int, str] = {}
        self.last_index: int | None = None
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.busy = 0          # payloads being staged right now
        self.owner: dict[str, int] = {}   # tensor name -> the bucket that carries it this round
        self.busy_index: set[int] = set()
        self.closed = False

    def _buffer(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Where `t` is staged: the store's reusable buffer when it offers one, else new memory."""
        buf = self.store.staging_buffer(name, t)
        return torch.empty_like(t, memory_format=torch.contiguous_format) if buf is None else buf

    def deliver(self, kind: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A transport message (`Adapter.deliver`) for this round, parsed by the receiving half."""
        return self.rx.deliver(kind, body, self)

    def _claim(self, payload: Payload, names: list[str]) -> bool:
        """Take the names of `payload` for this round; False: it was already staged (a retry)."""
        with self.lock:
            if self.closed:
                raise PayloadError(f"bucket {payload.index} arrived after the update round closed")
            if self.digests.get(payload.index) == payload.digest:
                return False                         # a retried bucket that was already staged
            again = [n for n in names if self.owner.get(n, payload.index) != payload.index
                     or payload.index in self.busy_index]
            if again:
                raise PayloadError(f"tensor {again[0]!r} was already sent in this round; a tensor "
                                   f"is sent once per round (bucket {payload.index} refused)")
            self.owner.update((n, payload.index) for n in names)
            self.busy_index.add(payload.index)
            self.busy += 1
        return True

    def _unclaim(self, payload: Payload, names: list[str], ok: bool) -> None:
        with self.lock:
            self.busy -= 1
            self.busy_index.discard(payload.index)
            if not ok:                               # a resend of this bucket may try again
                for n in names:
                    self.owner.pop(n, None)
            self.idle.notify_all()

    def _keep(self, payload: Payload, staged: list[tuple[str, torch.Tensor]], got: str) -> None:
        with self.lock:
            for n, t in staged:
                self.staged[n] = t
            self.digests[payload.index] = got
            if payload.last:
                self.last_index = payload.index

    def apply(self, header: Mapping[str, Any], body: memoryview | None = None) -> str:
        """Receive, decode and stage one payload; returns the digest of what was staged."""
        check_signature(self.key, self.version, header)
        buf = self.rx.receive(header, body)
        try:
            payload = Payload.from_header(header, buf)
            named = decode_checked(self.encoding, payload, self.store.get,
                                   lambda n, t: check_tensor(self.store, n, t))
            names = [n for n, _ in named]
            if not self._claim(payload, names):
                return payload.digest
            ok = False
            try:      # stage (one copy) and digest what was staged: that is what commit loads
                staged, got = stage_from(self.rx, header, named, self._buffer,
                                         digest_algo(payload.digest))
                check_digest(payload, got)
                ok = True
            finally:
                self._unclaim(payload, names, ok)
            self._keep(payload, staged, got)
        finally:
            self.rx.release(header)
        return got

    def streams(self, header: Mapping[str, Any]) -> bool:
        """Whether `apply_stream` can read this body straight into staging: in-band, a streaming
        encoding (raw, cast), xxh3 digests, and CPU tensors in the store."""
        if not (self.rx.in_band and self.encoding.streams
                and digest_algo(str(header.get("digest", ""))) == "xxh3"):
            return False
        for t in header.get("tensors") or []:
            live = self.store.get(str(t.get("name"))) if isinstance(t, Mapping) else None
            if live is not None and live.device.type != "cpu":
                return False
        return True

    def apply_stream(self, header: Mapping[str, Any], read_into: Callable[[memoryview], int],
                     nbytes: int) -> str:
        """`apply` for a body still arriving through `read_into(view)` (the http route): read
        straight into staging where `streams(header)`, else whole and then applied. Exactly
        `nbytes` are consumed either way (unless the request ends early), even on a refusal."""
        if not self.streams(header):
            body = bytearray(nbytes)
            read_exact(read_into, memoryview(body))
            return self.apply(header, memoryview(body))
        reader = BodyReader(read_into, nbytes)
        try:
            check_signature(self.key, self.version, header)
            payload = Payload.from_header(header, torch.empty(0, dtype=torch.uint8))
            if nbytes != payload_nbytes(header):
                raise PayloadError(f"bucket {payload.index}: {nbytes} body bytes announced, "
                                   f"{header.get('nbytes')} were sent; the request was truncated")
            names = unique_names(payload)
            if not self._claim(payload, names):
                reader.drain()
                return payload.digest
        except BaseException:
            reader.drain()
            raise
        ok = False
        try:
            staged, digests = read_staged(payload, reader, self._buffer_for,
                                          lambda n, t: check_tensor(self.store, n, t))
            got = combine_digests(digests)
            check_digest(payload, got)
            ok = True
        finally:
            self._unclaim(payload, names, ok)
        self._keep(payload, staged, got)
        return got

    def _buffer_for(self, name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        like = torch.empty(shape, dtype=dtype, device="meta")
        buf = self.store.staging_buffer(name, like)
        if buf is None or buf.device.type != "cpu" or not buf.is_contiguous():
            buf = torch.empty(shape, dtype=dtype)
        return buf

    def end(self) -> dict[int, str]:
        return round_digests(self.digests, self.last_index)

    def commit(self) -> None:
        self.end()
        self.store.load(self.staged)
        self.encoding.commit(self.version)
        self.close()

    def close(self) -> None:
        """No payload of this round writes to staging after close (the next round reuses it)."""
        with self.lock:
            self.closed = True
            self.idle.wait_for(lambda: self.busy == 0, timeout=60)
            self.staged.clear()
        self.rx.close()
