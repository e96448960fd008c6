"""Where a relayed body's bytes landed, and their piece-by-piece check as they land. A relay member
that stages as it receives reads the body straight into its staging buffers, so its bytes lie in
several places: `Spans` maps body offsets to them (no copy) so a child's feed sends any piece from
where it lies; `Landing` wraps `read_into`, hashes each piece as it lands and checks it before any
child may send it. Only memory that keeps its bytes (staging tensors, the caller's body buffer)
is forwarded in place; bytes read into anything else are copied first."""

from __future__ import annotations

import bisect
import ctypes
from typing import Any, Callable

import numpy as np

from weightsync.errors import PayloadError
from weightsync.wire.digests import Digest
from weightsync.transports.http.pieces import PIECE_HEADER


def address(view: memoryview) -> int:
    """The address of a writable, non-empty buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class Spans:
    """A body as the runs of memory its bytes landed in, each keeping its memory's owner alive."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.starts: list[int] = []
        self.runs: list[list[Any]] = []          # [body offset, address, length, owner]

    def __len__(self) -> int:
        return self.nbytes

    def add(self, at: int, view: memoryview) -> int:
        """Bytes [at, at + len(view)) now lie in `view`, whose address is returned."""
        n = len(view)
        where = address(view)
        last = self.runs[-1] if self.runs else None
        if last is not None and last[0] + last[2] == at and last[1] + last[2] == where:
            last[2] += n
            if view.obj is not last[-1]:
                last.append(view.obj)
            return where
        self.starts.append(at)
        self.runs.append([at, where, n, view.obj])
        return where

    def parts(self, a: int, b: int) -> list[memoryview]:
        """Bytes [a, b) as views of the memory they lie in (no copy)."""
        out: list[memoryview] = []
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        while a < b:
            if i >= len(self.runs) or self.runs[i][0] > a:
                raise ValueError(f"bytes {a}..{b} of the body have not landed")
            start, where, n = self.runs[i][:3]
            take = min(b, start + n) - a
            if take > 0:
                out.append(memoryview((ctypes.c_char * take).from_address(where + a - start)).cast("B"))
                a += take
            i += 1
        return out

    def __getitem__(self, s: slice) -> bytes:
        """A copy of bytes [s.start, s.stop) (what a test that alters a piece starts from)."""
        return b"".join(bytes(p) for p in self.parts(s.start or 0, self.nbytes if s.stop is None
                                                      else s.stop))


class Landing:
    """`read_into` for a relayed body that checks it as it lands: `check(k, digest)` when piece k
    is whole (raising stops the body), then `ready(a, b)` lets the feeds send bytes [a, b). After
    an error every read raises it again. `owned`: a body buffer of the caller's, never reused."""

    def __init__(self, read_into: Callable[[memoryview], int], nbytes: int, piece_bytes: int,
                 check: Callable[[int, str], None], ready: Callable[[int, int], None],
                 what: str = "the body", owned: Any = None) -> None:
        self.read_into, self.piece_bytes, self.what = read_into, piece_bytes, what
        self.owned, self.check, self.ready = owned, check, ready
        self.spans = Spans(nbytes)
        self.at = self.piece = 0
        self.digest = Digest(PIECE_HEADER)
        self.failed: BaseException | None = None

    def __call__(self, view: memoryview) -> int:
        if self.failed is not None:
            raise self.failed
        end = min(self.spans.nbytes, (self.piece + 1) * self.piece_bytes)
        if end > self.at:                  # a read ends at the piece's end: it is checked and
            view = view[: end - self.at]   # forwarded at once, not after a longer read fills
        k = self.read_into(view)
        if not k and len(view) and self.at < self.spans.nbytes:
            self.failed = PayloadError(f"{self.what}, piece {self.piece}: the relayed body ended "
                                       f"after {self.at} of {self.spans.nbytes} bytes")
            raise self.failed
        if k:
            try:
                self._landed(view[:k])
            except BaseException as e:
                self.failed = e
                raise
        return k

    def _landed(self, view: memoryview) -> None:
        if not (view.obj is self.owned or isinstance(view.obj, np.ndarray)):
            view = memoryview(bytearray(view))       # memory that may be read into again
        where, n, off = self.spans.add(self.at, view), len(view), 0
        while off < n:
            end = min(self.spans.nbytes, (self.piece + 1) * self.piece_bytes)
            take = min(n - off, end - self.at)
            self.digest.update_at(where + off, take)
            self.at += take
            off += take
            if self.at == end:
                got, a = self.digest.hexdigest(), self.piece * self.piece_bytes
                self.check(self.piece, got)
                self.ready(a, end)
                self.piece += 1
                self.digest = Digest(PIECE_HEADER)
