"""Encoding `cast`: floating tensors cast to one dtype (bf16, fp16, fp32) before they travel, so
an fp32 trainer feeds a bf16 engine at half the bytes. Lossy by design; the digest is taken over
the cast tensors, which are what the engine must end with."""

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
