"""The steps of receiving one payload, shared by `ReceiveSession` and engines with their own
session (the vLLM backend): build the round's encoding and transport receiver, read a body
exactly, decode, stage private copies while hashing them, and check the sender's digest."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from weightsync.wire.bucket import (combine_digests, digest_tensors, dtype_name, tensor_bytes,
                                    tensor_header)
from weightsync.config import ComponentRef, build_options
from weightsync.errors import PayloadError
from weightsync.wire.digests import copy_digest_many
from weightsync.interfaces import Encoding, Payload, TransportReceiver


def round_digests(digests: Mapping[int, str], last_index: int | None) -> dict[int, str]:
    """The digests of a complete round, or an error naming what never arrived."""
    if last_index is None:
        raise PayloadError("the round ended before the last bucket arrived")
    missing = sorted(set(range(last_index + 1)) - set(digests))
    if missing:
        raise PayloadError(f"buckets {missing} never arrived")
    return dict(digests)


def build_encoding(ref: Mapping[str, Any], components: Any) -> Encoding:
    """The encoding a plan names, built in the engine's process from its own registry."""
    r = ComponentRef.model_validate(ref)
    cls = components.encodings.get(r.kind)
    return cls(build_options(cls, r, "encoding"))


def build_receiver(ref: Mapping[str, Any], components: Any) -> TransportReceiver:
    """The receiving half of the transport a plan names."""
    r = ComponentRef.model_validate(ref)
    cls = components.transports.get(r.kind)
    if cls.receiver is None:
        raise PayloadError(f"transport {r.kind!r} has no receiving half for this engine")
    return cls.receiver(build_options(cls, r, "transport"))


def unique_names(payload: Payload) -> list[str]:
    """The payload's tensor names in header order; a name twice is refused."""
    names = [s.name for s in payload.specs]
    if len(set(names)) != len(names):                 # the quadratic search only on a refusal
        dup = next(n for n in names if names.count(n) > 1)
        raise PayloadError(f"bucket {payload.index} names tensor {dup!r} twice; a tensor is sent "
                           f"once per round")
    return names


def decode_checked(encoding: Encoding, payload: Payload, current: Callable[[str], torch.Tensor | None],
                   check: Callable[[str, torch.Tensor], Any]) -> list[tuple[str, torch.Tensor]]:
    """Decode a payload into its tensors in header order, each checked by `check(name, t)`."""
    order = unique_names(payload)
    decoded = dict(encoding.decode(payload, current))
    if set(decoded) != set(order):
        raise PayloadError(f"bucket {payload.index}: decoded tensors {sorted(decoded)} "
                           f"differ from the header's {sorted(order)}")
    named = [(n, decoded[n]) for n in order]
    for n, t in named:
        check(n, t)
    return named


def stage_digest(named: list[tuple[str, torch.Tensor]],
                 buffer: Callable[[str, torch.Tensor], torch.Tensor], algo: str,
                 private: bool = False) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """Copy each tensor into `buffer(name, t)` and return the copies and their bucket digest
    (`algo`): xxh3 on CPU in one pass (`copy_digest`), else copy, then digest. `private`: memory
    only this process writes, hashed as it is read; otherwise hashed from the copy."""
    bufs = [(n, buffer(n, t)) for n, t in named]
    if algo == "xxh3" and all(t.device.type == "cpu" for _, t in named):
        digests = copy_digest_many([(b, t, tensor_header(n, t)) for (n, t), (_, b) in zip(named, bufs)],
                                   source=private)
        return bufs, combine_digests(digests)
    for (_, t), (_, b) in zip(named, bufs):
        b.copy_(t)
    return bufs, digest_tensors(bufs, algo)


def payload_nbytes(header: Mapping[str, Any]) -> int:
    try:
        return int(header["nbytes"])
    except (KeyError, TypeError, ValueError):
        raise PayloadError("payload header lacks a valid 'nbytes'") from None


def read_exact(read_into: Callable[[memoryview], int], view: memoryview) -> None:
    """Fill `view` from `read_into`; PayloadError when the stream ends first."""
    got, n = 0, len(view)
    while got < n:
        k = read_into(view[got:])
        if not k:
            raise PayloadError(f"request body ended after {got} of {n} bytes")
        got += k


class BodyReader:
    """A payload body arriving through `read_into`, read in pieces small enough for the cache."""

    PIECE = 256 << 10

    def __init__(self, read_into: Callable[[memoryview], int], nbytes: int) -> None:
        self.read_into, self.left, self.total = read_into, nbytes, nbytes

    def exact(self, view: memoryview, feed: Callable[[int, int], Any] | None = None) -> None:
        """Fill `view`; `feed(offset, count)` after each piece lands in it."""
        n = len(view)
        if n > self.left:
            raise PayloadError(f"the payload body is {self.total} bytes; its header describes more")
        got = 0
        while got < n:
            k = self.read_into(view[got: got + min(self.PIECE, n - got)])
            if not k:
                self.left = 0
                raise PayloadError(f"request body ended {self.total - self.left + got} bytes in, "
                                   f"of {self.total}")
            if feed is not None:
                feed(got, k)
            got += k
        self.left -= n

    def drain(self) -> None:
        """Read and drop the rest (a refused payload), so the connection stays in step."""
        scratch = memoryview(bytearray(min(self.PIECE, max(self.left, 1))))
        while self.left > 0:
            k = self.read_into(scratch[: min(len(scratch), self.left)])
            if not k:
                self.left = 0
                return
            self.left -= k


def read_staged(payload: Payload, reader: BodyReader,
                buffer_for: Callable[[str, torch.dtype, list[int]], torch.Tensor],
                check: Callable[[str, torch.Tensor], Any]) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """Read a safetensors body from `reader` straight into one CPU buffer per tensor
    (`buffer_for(name, dtype, shape)`), hashing each piece as it lands: the staged tensors and
    their xxh3-128 digests in header order. The body's header is checked against the payload's
    and `check` before any tensor byte is read; a refused body is drained."""
    from weightsync.wire.digests import Digest
    from weightsync.wire.frame import header_length, parse_header
    specs = {s.name: s for s in payload.specs}
    out: dict[str, tuple[torch.Tensor, str]] = {}
    try:
        prefix = memoryview(bytearray(8))
        reader.exact(prefix)
        hlen = header_length(prefix, reader.total)
        raw = memoryview(bytearray(hlen))
        reader.exact(raw)
        entries, _ = parse_header(raw, reader.total)
        if sorted(e[0] for e in entries) != sorted(specs):
            raise PayloadError(f"bucket {payload.index}: the body carries tensors "
                               f"{sorted(e[0] for e in entries)[:5]}.., the header "
                               f"{sorted(specs)[:5]}..")
        entries.sort(key=lambda e: (e[3], e[4]))
        at = 0
        for name, dtype, shape, a, b in entries:
            spec = specs[name]
            if dtype_name(dtype) != spec.dtype or tuple(shape) != tuple(spec.shape):
                raise PayloadError(f"tensor {name!r}: the body says {dtype_name(dtype)} {shape}, "
                                   f"the header {spec.dtype} {list(spec.shape)}")
            if a != at:
                raise PayloadError(f"tensor {name!r}: data at {a}, expected {at} (the tensors "
                                   f"must tile the body)")
            at = b
            check(name, torch.empty(shape, dtype=dtype, device="meta"))
        if at != reader.left:
            raise PayloadError(f"bucket {payload.index}: tensors end at {at} of a {reader.left}-byte "
                               f"data section")
        for name, dtype, shape, a, b in entries:
            buf = buffer_for(name, dtype, shape)
            d = Digest(tensor_header(name, buf))
            if b > a:
                base = buf.data_ptr()
                reader.exact(tensor_bytes(buf), lambda off, k: d.update_at(base + off, k))
            out[name] = (buf, d.hexdigest())
    except BaseException:
        reader.drain()
        raise
    order = [s.name for s in payload.specs]
    return [(n, out[n][0]) for n in order], [out[n][1] for n in order]


def stage_from(rx: TransportReceiver, header: Mapping[str, Any], named: list[tuple[str, torch.Tensor]],
               buffer: Callable[[str, torch.Tensor], torch.Tensor], algo: str
               ) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """`stage_digest` of a body `rx` lent for `header`: hashed as it is read where `rx.private`
    or `rx.hash_source(header)` vouches for it (then `rx.unchanged(header)` after the copy)."""
    vouch = rx.hash_source(header)
    private = bool(vouch) if vouch is not None else bool(rx.private)
    out = stage_digest(named, buffer, algo, private)
    rx.unchanged(header)
    return out


def check_digest(payload: Payload, got: str) -> None:
    if got != payload.digest:
        first = payload.specs[0].name if payload.specs else "-"
        raise PayloadError(f"bucket {payload.index} (tensors {first!r}..): digest {got} does not "
                           f"match the sender's {payload.digest}; the payload was corrupted in "
                           f"transit and nothing was applied")
