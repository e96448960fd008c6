"""Encoding `raw`: the bucket's tensors, unchanged, in safetensors layout."""

from __future__ import annotations

from typing import Callable

import torch

from weightsync.wire.bucket import Bucket, combine_digests
from weightsync.interfaces import Alloc, Encoding, Payload
from weightsync.wire.frame import pack, pack_digest, safetensors_layout, unpack


def pack_bucket(name: str, bucket: Bucket, alloc: Alloc | None = None,
                cast: torch.dtype | None = None) -> Payload:
    """Pack `bucket` (into `alloc`'s buffer when given); the digest is of the packed tensors."""
    layout = safetensors_layout(bucket.tensors, cast=cast)
    size = len(layout[0]) + sum(t.numel() * dt.itemsize for _, t, _, dt in layout[1])
    out = alloc(size) if alloc is not None else None
    if cast is None and (out is None or out.device.type == "cpu"):
        # one pass: each tensor is hashed while it is written into the buffer
        body, digests = pack_digest(bucket.tensors, out=out, layout=layout)
        digest = combine_digests([digests[n] for n in bucket.names])
        bucket._digest = digest
        return Payload(bucket.index, bucket.last, name, digest, bucket.specs(), body)
    body = pack(bucket.tensors, out=out, cast=cast)
    views = dict(unpack(body)[0])
    target = bucket.with_tensors([(n, views[n]) for n in bucket.names])
    if cast is None:
        bucket._digest = target.digest()
    return Payload(bucket.index, bucket.last, name, target.digest(), target.specs(), body)


def unpack_payload(payload: Payload) -> list[tuple[str, torch.Tensor]]:
    return unpack(payload.body)[0]


class RawEncoding(Encoding):
    name = "raw"
    streams = True      # the wire form is the target tensors in safetensors layout (apply_stream)

    def encode(self, bucket: Bucket, alloc: Alloc | None = None) -> Payload:
        return pack_bucket(self.name, bucket, alloc)

    def decode(self, payload: Payload, current: Callable[[str], torch.Tensor | None]
               ) -> list[tuple[str, torch.Tensor]]:
        return unpack_payload(payload)
