"""The engine half of a round inside a vLLM worker, free of vLLM imports so it is testable alone.

vLLM's live parameters are not in checkpoint format (on CPU the linear weights are packed into
oneDNN handles and `weight` is an empty tensor; on GPU q/k/v are fused), so the receiver checks
names and shapes against the *checkpoint* the server loaded (its safetensors headers), keeps the
last committed checkpoint-format tensors as the delta base, and stages a whole round before a
single layerwise reload applies it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from weightsync.wire.bucket import digest_algo, dtype_from_name
from weightsync.errors import PayloadError
from weightsync.interfaces import Encoding, Payload, TransportReceiver
from weightsync.wire.frame import read_file_header
from weightsync.wire.signing import check as check_signature
from weightsync.wire.bucket import combine_digests
from weightsync.transports.http.member_fetch import FetchSpec, fetch_body
from weightsync.receive import (BodyReader, build_encoding, build_receiver, check_digest,
                                 check_tensor, decode_checked, payload_nbytes, read_exact,
                                 read_staged, round_digests, stage_from)

_ST_TO_TORCH = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (names, dtypes, shapes) without reading its data."""
    return read_file_header(path)[1]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    folder = Path(model_dir)
    if not folder.is_dir():
        raise PayloadError(f"the weightsync backend needs the served model as a local directory; "
                           f"{model_dir!r} is not one (serve a downloaded snapshot by path)")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise PayloadError(f"model directory {model_dir} holds no *.safetensors files")
    return files


class CheckpointIndex:
    """What the engine's checkpoint holds, by Hugging Face name: dtype and shape from the file
    headers, and each tensor's current value (last committed, else read from the file)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.files: dict[str, Path] = {}
        self.live: dict[str, torch.Tensor] = {}
        self.rebase(model_dir)

    def rebase(self, model_dir: str | Path) -> None:
        """Point at a (new) checkpoint directory; forget committed values."""
        specs, files = {}, {}
        for f in checkpoint_files(model_dir):
            for name, info in read_safetensors_header(f).items():
                specs[name] = (dtype_from_name(_ST_TO_TORCH[info["dtype"]]), tuple(info["shape"]))
                files[name] = f
        self.specs, self.files, self.live = specs, files, {}

    # WeightStore-like surface used by core's check_tensor
    def names(self) -> list[str]:
        return list(self.specs)

    def get(self, name: str) -> torch.Tensor | None:
        """A meta tensor with the checkpoint's dtype and shape (for checks; no data read)."""
        spec = self.specs.get(name)
        return None if spec is None else torch.empty(spec[1], dtype=spec[0], device="meta")

    def current(self, name: str) -> torch.Tensor | None:
        """The engine's value of `name` in checkpoint format: the delta base."""
        if name in self.live:
            return self.live[name]
        if name not in self.files:
            return None
        from safetensors import safe_open
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def check(self, name: str, t: torch.Tensor) -> None:
        check_tensor(self, name, t)

    def total_bytes(self) -> int:
        """The checkpoint's size: no payload can be larger (plus its header)."""
        total = 0
        for dtype, shape in self.specs.values():
            n = dtype.itemsize
            for d in shape:
                n *= d
            total += n
        return total


def _fresh(name: str, t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _fresh_for(name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class StagedRound:
    """One update round: every bucket is received, decoded, checked (names, shapes, dtypes,
    digest) and staged; nothing reaches the model until `tensors()` is loaded at finish."""

    def __init__(self, index: CheckpointIndex, encoding: Encoding, rx: TransportReceiver,
                 version: int | None, hmac_key: bytes | None = None) -> None:
        self.index = index
        self.hmac_key = hmac_key           # payloads must carry the trainer's signature
        self.encoding = encoding
        self.rx = rx
        self.version = version
        self.staged: dict[str, torch.Tensor] = {}
        self.digests: dict[int, str] = {}
        self.last_index: int | None = None
        self.aborted = False
        self.rid: str | None = None           # the weightsync round this staging belongs to
        self.offered: list[str] = []          # bodies offered to the engines this one feeds
        self.relay: dict[str, Any] = {"buckets": 0, "from_parent": 0, "from_trainer": 0,
                                      "fallbacks": []}

    def deliver(self, kind: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A transport message for this round (`Adapter.deliver`, sent whole in update_info):
        the round's transport receiving half parses it, staging through `apply`."""
        return self.rx.deliver(kind, body, self)

    def apply(self, header: Mapping[str, Any], body: memoryview | None = None) -> str:
        """Stage one payload (what a receiving half stages into: `weightsync.interfaces.Stages`)."""
        return self.stage(header, body)

    def stage(self, header: Mapping[str, Any], body: memoryview | None) -> str:
        check_signature(self.hmac_key, int(self.version or 0), header)
        buf = self.rx.receive(header, body)
        try:
            payload = Payload.from_header(header, buf)
            named = decode_checked(self.encoding, payload, self.index.current, self.index.check)
            # one pass per tensor: copied out of the transport's buffer and hashed as it lands
            copies, got = stage_from(self.rx, header, named, _fresh, digest_algo(payload.digest))
            check_digest(payload, got)
            self.staged.update(copies)
            self.digests[payload.index] = got
            if payload.last:
                self.last_index = payload.index
            return got
        finally:
            self.rx.release(header)

    def stage_fetched(self, header: Mapping[str, Any], ref: Mapping[str, Any],
                      server: Any = None) -> str:
        """`stage` for a body the worker fetches from the trainer's body server: straight into
        fresh staging tensors, each piece hashed as it lands (raw and cast payloads with xxh3
        digests); other encodings read the body whole and go through `stage`. A fetch with a
        "relay" part comes through the relay tree (`weightsync.transports.http.member_fetch`): from a parent
        engine, checked piece by piece, offered on `server` to the engines this one feeds."""
        from weightsync.net.bodyserver import fetch
        check_signature(self.hmac_key, int(self.version or 0), header)
        payload = Payload.from_header(header, torch.empty(0, dtype=torch.uint8))
        if int(ref.get("nbytes", -1)) != payload_nbytes(header):
            raise PayloadError(f"bucket {payload.index}: the fetch reference is for "
                               f"{ref.get('nbytes')} bytes, the header says {header.get('nbytes')}")
        cap = self.index.total_bytes() + (16 << 20)
        spec = FetchSpec.parse(ref)
        if spec is not None:
            if server is None:            # not rank 0: it takes the bytes, feeds no one
                spec.serve = None
            got = fetch_body(ref, spec, server, max_bytes=cap, timeout=300.0)
            self.offered += got.offered
            self.relay["buckets"] += 1
            self.relay["from_parent"] += got.from_parent
            self.relay["from_trainer"] += len(got.body) - got.from_parent
            if got.reason:
                self.relay["fallbacks"] = [*self.relay["fallbacks"][-19:],
                                           f"bucket {payload.index}: {got.reason}"]
            return self.stage(header, got.body)
        if not (self.encoding.streams and digest_algo(payload.digest) == "xxh3"):
            def whole(read_into: Any, n: int) -> memoryview:
                body = memoryview(bytearray(n))
                read_exact(read_into, body)
                return body
            return self.stage(header, fetch(ref, whole, max_bytes=cap))
        order = [s.name for s in payload.specs]
        if len(set(order)) != len(order):
            raise PayloadError(f"bucket {payload.index} names a tensor twice; a tensor is sent once per round")
        staged, digests = fetch(ref, lambda read_into, n: read_staged(
            payload, BodyReader(read_into, n), _fresh_for, self.index.check), max_bytes=cap)
        digest = combine_digests(digests)
        check_digest(payload, digest)
        self.staged.update(staged)
        self.digests[payload.index] = digest
        if payload.last:
            self.last_index = payload.index
        return digest

    def end(self) -> dict[int, str]:
        return round_digests(self.digests, self.last_index)


__all__ = ["CheckpointIndex", "StagedRound", "build_encoding", "build_receiver", "read_safetensors_header"]
