"""Encoding `cast`: floating tensors cast to one dtype before they travel (an fp32 trainer feeds a
bf16 engine at half the bytes); lossy, the digest is of the cast tensors."""

from __future__ import annotations

from typing import Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict

from weightsync.wire.bucket import Bucket, dtype_from_name
from weightsync.interfaces import Alloc, Encoding, Payload
from weightsync.encodings.raw import pack_bucket, unpack_payload


class CastOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


class CastEncoding(Encoding):
    name = "cast"
    Options = CastOptions
    lossless = False
    streams = True      # the wire form is the target tensors in safetensors layout (apply_stream)

    def encode(self, bucket: Bucket, alloc: Alloc | None = None) -> Payload:
        return pack_bucket(self.name, bucket, alloc, cast=dtype_from_name(self.options.dtype))

    def decode(self, payload: Payload, current: Callable[[str], torch.Tensor | None]
               ) -> list[tuple[str, torch.Tensor]]:
        return unpack_payload(payload)
