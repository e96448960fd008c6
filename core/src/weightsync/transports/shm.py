"""Transport `shm`: the trainer and its engines share one host. Payloads are written straight
into shared buffers (`alloc`), and each engine is told where they are with an announce whose
header is JSON only (segment name, offset, nbytes; or a CUDA IPC handle when the buffers live on
a GPU). The engine reads the bytes in place; nothing is pickled and nothing travels over HTTP but
the header.

Double-buffered: `segments` buffers (2 by default) of the largest payload size are used in turn.
`send` announces bucket i and returns at once, so the exporter fills the other buffer while the
engines read this one; `alloc` blocks until the buffer it hands out is released, i.e. every
engine's announce for the payload that was in it returned (the engine staged it) or failed.

No leaked segments, by construction:
- segment names carry the sender's pid and a random token: ``weightsync-<pid>-<token>-<k>``;
- the sender registers every name with Python's resource tracker (the helper process that
  multiprocessing.shared_memory uses). When the sender dies, even by SIGKILL, the tracker sees its
  pipe close and unlinks every name still registered. A normal close() unlinks and unregisters;
- with ``keep_segments: false`` the names are also unlinked at the end of every sync, at the cost
  of fresh (page-faulting) memory for the next one;
- receivers open segments read-only and never create or unlink them; their mappings of an
  unlinked segment are released when they drop them (the kernel frees the memory then).
A receiver validates names against that pattern, so a header cannot point it at another file.

Generations: the last 64 bytes of a CPU segment hold a counter that `alloc` bumps before the
buffer is written again, and every announce carries the value it was sent under. A receiver
checks it before it copies and again after: a buffer rewritten while an engine still read it
(which the release protocol above rules out) would be refused, never staged. That is what lets a
receiver hash each piece as it reads it and stream it into staging (two memory transfers per
byte, as for a bare copy) instead of hashing the copy afterwards.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import threading
import time
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..errors import PayloadError, TransportError
from ..interfaces import Adapter, Payload, Transport, TransportReceiver

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
PREFIX = "weightsync-"
GEN_BYTES = 64                   # a CPU segment's tail: the buffer's generation (u64 little-endian)
NAME_RE = re.compile(r"^weightsync-[0-9]+-[0-9a-f]+-[0-9]+$")


class ShmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    segments: int = Field(2, ge=1, le=8, description="buffers used in turn (2 = double-buffered)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cpu: POSIX shared memory; cuda: CUDA IPC; auto: cuda when available")
    timeout: float = Field(600.0, gt=0, description="seconds alloc waits for a buffer to be released")
    keep_segments: bool = Field(True, description="keep buffers between syncs (false: unlink at "
                                                  "the end of every sync)")


# -- segments ---------------------------------------------------------------------------------
def _tracker(op: str, name: str) -> None:
    """Register/unregister `name` with multiprocessing's resource tracker (the reaper that
    unlinks it if this process dies without doing so)."""
    from multiprocessing import resource_tracker
    try:
        getattr(resource_tracker, op)("/" + name, "shared_memory")
    except Exception as e:  # noqa: BLE001 - the tracker is a safety net, not a requirement
        log.warning("resource tracker %s of %s failed: %s", op, name, e)


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


@dataclass
class Segment:
    """One shared buffer of the sender, and whether an engine may still be reading it."""

    index: int
    name: str | None = None
    size: int = 0
    tensor: torch.Tensor | None = None
    mm: mmap.mmap | None = None
    ipc: dict[str, Any] | None = None
    free: threading.Event = field(default_factory=threading.Event)
    readers: dict[str, Any] = field(default_factory=dict)   # engine -> its announce (is_alive)
    generation: int = 0

    def __post_init__(self) -> None:
        self.free.set()

    def contains(self, t: torch.Tensor) -> bool:
        if self.tensor is None or t.device != self.tensor.device:
            return False
        base = self.tensor.data_ptr()
        return base <= t.data_ptr() and t.data_ptr() + t.numel() <= base + self.size

    def drop(self) -> None:
        """Unlink the name (CPU) and let go of the memory."""
        if self.name is not None:
            unlink(self.name)
            _tracker("unregister", self.name)
        self.tensor, self.ipc, self.name, self.size = None, None, None, 0
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:      # a payload view is still referenced; GC unmaps it later
                pass
            self.mm = None


def create_cpu_segment(name: str, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    _tracker("register", name)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        unlink(name)
        _tracker("unregister", name)
        raise
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


# -- receiving side ---------------------------------------------------------------------------
_MAPS: OrderedDict[str, tuple[Any, torch.Tensor]] = OrderedDict()
_MAPS_LOCK = threading.Lock()
_MAX_MAPS = 8


def _open_cpu(name: str) -> torch.Tensor:
    if not NAME_RE.match(name):
        raise PayloadError(f"shm segment name {name!r} is not a weightsync segment")
    with _MAPS_LOCK:
        hit = _MAPS.get(name)
        if hit is not None:
            _MAPS.move_to_end(name)
            return hit[1]
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except FileNotFoundError:
        raise PayloadError(f"shm segment {name} does not exist; the sender is gone or runs on "
                           f"another host (use transport 'collective' or 'http' there)") from None
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # read-only buffer: the receiver never writes
        t = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    with _MAPS_LOCK:
        _MAPS[name] = (mm, t)
        while len(_MAPS) > _MAX_MAPS:
            _MAPS.popitem(last=False)             # unmapped when the last view is dropped
    return t


def _open_cuda(handle: Mapping[str, Any]) -> torch.Tensor:
    """The sender's CUDA buffer. A sender's caching allocator hands out new buffers inside the
    same device allocation (same IPC handle, other offset or size) when it grows a segment, so a
    mapping is cached under the whole geometry, and a stale mapping of the same handle is dropped
    before the new one is opened (torch's own cache would otherwise return the old storage)."""
    from .cuda_ipc import open_buffer
    geometry = tuple(handle.get(k) for k in ("handle", "storage_offset", "storage_bytes",
                                              "tensor_offset", "numel"))
    key = "cuda:" + ":".join(map(str, geometry))
    with _MAPS_LOCK:
        hit = _MAPS.get(key)
        if hit is not None:
            _MAPS.move_to_end(key)
            return hit[1]
        stale = f"cuda:{geometry[0]}:{geometry[1]}:"
        for k in [k for k in _MAPS if k.startswith(stale)]:
            del _MAPS[k]
    t = open_buffer(handle)
    with _MAPS_LOCK:
        _MAPS[key] = (None, t)
        while len(_MAPS) > _MAX_MAPS:
            _MAPS.popitem(last=False)
    return t


def _generation(buf: torch.Tensor) -> int:
    tail = buf[buf.numel() - GEN_BYTES: buf.numel() - GEN_BYTES + 8]
    return int.from_bytes(bytes(tail.numpy()), "little")


class ShmReceiver(TransportReceiver):
    """Maps the sender's segment (cached: the same buffers come back every bucket) and returns a
    zero-copy view of the payload body."""

    def hash_source(self, header: Mapping[str, Any]) -> bool:
        """The body may be hashed as it is read (not from the copy): its buffer has a generation
        that `unchanged` checks after the copy."""
        tr = header.get("transport") or {}
        return "generation" in tr and "cuda_ipc" not in tr

    def unchanged(self, header: Mapping[str, Any]) -> None:
        """After staging: the sender did not start rewriting the buffer meanwhile."""
        tr = header.get("transport") or {}
        if "generation" in tr and "cuda_ipc" not in tr:
            if _generation(_open_cpu(str(tr.get("segment")))) != int(tr["generation"]):
                raise PayloadError(f"bucket {header.get('index')}: the sender rewrote shm buffer "
                                   f"{tr.get('segment')} while this engine read it; nothing was "
                                   f"staged (resend it)")

    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        tr = header.get("transport") or {}
        try:
            offset, nbytes = int(tr["offset"]), int(tr["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise PayloadError("shm announce header lacks transport.offset/nbytes") from None
        if nbytes != int(header.get("nbytes", nbytes)):
            raise PayloadError(f"bucket {header.get('index')}: transport says {nbytes} bytes, "
                               f"payload says {header.get('nbytes')}")
        if "cuda_ipc" in tr:
            buf = _open_cuda(tr["cuda_ipc"])
        else:
            buf = _open_cpu(str(tr.get("segment")))
        room = buf.numel()
        if "generation" in tr and "cuda_ipc" not in tr:
            room -= GEN_BYTES
            if room < 0 or _generation(buf) != int(tr["generation"]):
                raise PayloadError(f"bucket {header.get('index')}: shm buffer {tr.get('segment')} "
                                   f"was already reused by the sender; nothing was staged")
        if offset < 0 or offset + nbytes > room:
            raise PayloadError(f"shm view {offset}+{nbytes} exceeds segment of {room} bytes")
        return buf[offset: offset + nbytes]


def forget_mappings() -> None:
    """Drop every cached mapping (tests; an engine switching trainers)."""
    with _MAPS_LOCK:
        _MAPS.clear()


# -- sending side -----------------------------------------------------------------------------
class _Read:
    """An engine's announce of one buffer, running on the transport's pool (`is_alive` as a
    thread's, for the bookkeeping that asks who still reads a buffer)."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def is_alive(self) -> bool:
        return not self.future.done()


class ShmTransport(Transport):
    name = "shm"
    Options = ShmOptions
    requires = "announce"
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
    def _fresh_name(self) -> str:
        self.created += 1
        return f"{PREFIX}{os.getpid()}-{self.token}-{self.created}"

    def _grow(self, seg: Segment, nbytes: int) -> None:
        seg.drop()
        size = max(nbytes, 1)
        if self.device == "cuda":
            from .cuda_ipc import export_buffer
            seg.tensor = torch.empty(size, dtype=torch.uint8, device="cuda")
            seg.ipc = export_buffer(seg.tensor)
        else:
            seg.name = self._fresh_name()
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
            busy = sorted(n for n, t in seg.readers.items() if t.is_alive())
            raise TransportError(f"shm buffer {seg.index} is still being read by {busy} after "
                                 f"{self.options.timeout}s; raise transport option 'timeout' or "
                                 f"check those engines")
        seg.free.clear()             # taken: filled now, released when its announces return
        seg.readers = {}
        if seg.size < nbytes:
            self._grow(seg, nbytes)
        self._bump(seg)
        return seg.tensor[:nbytes]

    def _segment_of(self, body: torch.Tensor) -> Segment | None:
        return next((s for s in self.segs if s.contains(body)), None)

    # -- sync ---------------------------------------------------------------------------------
    def open(self, engines: Sequence[Adapter], version: int) -> dict[str, BaseException]:
        self._wait_all(self.options.timeout)
        with self.lock:
            self.turn = 0
            for s in self.segs:          # a payload allocated by an aborted sync was never sent
                if not any(t.is_alive() for t in s.readers.values()):
                    s.readers.clear()
                    s.free.set()
        self.errors.clear()
        return {}

    def _announce(self, seg: Segment, adapter: Adapter, header: dict[str, Any]) -> None:
        try:
            adapter.announce(header)
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
        offset = body.data_ptr() - seg.tensor.data_ptr()
        fields: dict[str, Any] = {"offset": offset, "nbytes": body.numel(), "device": body.device.type}
        if seg.ipc is not None:
            fields["cuda_ipc"] = seg.ipc
        else:
            fields["segment"] = seg.name
            fields["generation"] = seg.generation
        header = payload.header(**fields)
        with self.lock:
            failed = {n: e for n, e in self.errors.items()}
        targets = [a for a in engines if a.engine_name not in failed]
        if self._pool is None:       # announce threads kept from bucket to bucket
            self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(targets)),
                                            thread_name_prefix="ws-shm")
        reads = [self._pool.submit(self._announce, seg, a, header) for a in targets]
        seg.readers = {a.engine_name: _Read(f) for a, f in zip(targets, reads)}
        left = [len(reads)]
        lock = threading.Lock()

        def read(_: Future) -> None:       # the buffer is free once every engine staged it
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    seg.free.set()
        if not reads:
            seg.free.set()
        for f in reads:
            f.add_done_callback(read)
        return failed

    def discard(self, payload: Payload) -> None:
        seg = self._segment_of(payload.body)
        if seg is not None and not any(t.is_alive() for t in seg.readers.values()):
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
                for n, t in s.readers.items():
                    if t.is_alive():
                        fails.setdefault(n, TransportError(
                            f"engine did not finish reading shm buffer {s.index} within "
                            f"{self.options.timeout}s"))
        if not self.options.keep_segments:
            self._drop_free()
        return fails

    def _drop_free(self) -> None:
        for s in self.segs:
            if s.free.is_set():
                s.drop()

    def close(self) -> None:
        self._wait_all(min(self.options.timeout, 30.0))
        for s in self.segs:
            s.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def segment_names(self) -> list[str]:
        return [s.name for s in self.segs if s.name]
