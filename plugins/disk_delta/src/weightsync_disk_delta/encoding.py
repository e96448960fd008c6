"""Encoding `delta`: only the elements that changed since the last version the engines hold.

The sender keeps that version on CPU (seeded from the checkpoint the engines started from, or from
a first full sync) and updates it in place as buckets are encoded, with an undo log of exactly the
changed elements, so a failed sync rolls back without ever holding two copies of the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from pydantic import BaseModel, ConfigDict, Field

from weightsync.bucket import Bucket, digest_tensors
from weightsync.errors import ConfigError, PayloadError
from weightsync.interfaces import Alloc, Encoding, Payload
from weightsync.wire import pack, packed_size, unpack

from .codec import apply_entry, bits, encode_tensor

FORMAT = "weightsync-delta/1"


class DeltaOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    density_threshold: float = Field(0.25, ge=0, le=1, description=(
        "a tensor with a larger fraction of changed elements ships whole"))
    zstd_level: int = Field(1, ge=1, le=19, description="zstd level of the xor form")
    xor_min_density: float = Field(0.02, ge=0, le=1, description=(
        "below this density only the sparse form is tried: it is exactly the ideal size there, "
        "and compressing costs more time than the bytes it saves"))
    base_checkpoint: str | None = Field(None, description=(
        "directory of *.safetensors the engines started from (version `base_version`); "
        "unset: the first sync is full"))
    base_version: int = Field(0, ge=0)
    full_every: int = Field(0, ge=0, description="every N versions a full version (0: never forced)")
    full_when_chain_exceeds: float = Field(1.0, ge=0, description=(
        "a full version once the deltas since the last full one weigh this many full ones "
        "(0: never)"))


def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"delta encoding: base_checkpoint {path} holds no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


class DeltaEncoding(Encoding):
    name = "delta"
    Options = DeltaOptions
    lossless = True

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self._base: dict[str, torch.Tensor] | None = None
        self._digests: dict[str, str] = {}
        self.base_version: int | None = None
        self._seeded = False
        self._pending: int | None = None
        self._undo: dict[str, tuple] = {}
        self._full = False
        self._last_full: int | None = None
        self._chain_bytes = 0          # wire bytes of the deltas since the last full version
        self._full_bytes = 0           # logical bytes of a full version
        self._sync_bytes = 0
        self._engine_version: int | None = None
        self._all_full = True

    # -- sender side ------------------------------------------------------------------------
    def _seed(self) -> None:
        self._seeded = True
        if self.options.base_checkpoint:
            self._base = {n: t.contiguous() for n, t in load_checkpoint(self.options.base_checkpoint).items()}
            self._digests = {n: digest_tensors([(n, t)]) for n, t in self._base.items()}
            self.base_version = self.options.base_version

    def begin(self, version: int) -> None:
        if not self._seeded:
            self._seed()
        if self.base_version is not None and version <= self.base_version:
            raise PayloadError(f"delta encoding: version {version} is not above the base version "
                               f"{self.base_version}; push a higher version")
        o = self.options
        self._full = (self._base is None
                      or (o.full_every > 0 and self._last_full is not None
                          and version - self._last_full >= o.full_every)
                      or (o.full_when_chain_exceeds > 0 and self._full_bytes > 0
                          and self._chain_bytes >= o.full_when_chain_exceeds * self._full_bytes))
        self._pending = version
        self._undo = {}
        self._sync_bytes = 0
        self._all_full = True
        if self._base is None:
            self._base = {}

    def encode(self, bucket: Bucket, alloc: Alloc | None = None) -> Payload:
        if self._pending is None:      # used without the pipeline's lifecycle: behave as one sync
            self.begin((self.base_version or 0) + 1)
        assert self._base is not None
        o = self.options
        entries: dict[str, Any] = {}
        arrays: list[tuple[str, torch.Tensor]] = []
        changed_total = 0
        tensors = [(name, t.detach().cpu().contiguous()) for name, t in bucket.tensors]
        digests = fused_digests(bucket, tensors)
        for name, t in tensors:
            base = self._base.get(name)
            enc = encode_tensor(name, t, base, density_threshold=o.density_threshold,
                                zstd_level=o.zstd_level, xor_min_density=o.xor_min_density,
                                force_full=self._full)
            digest = digests[name]
            entry = {**enc.entry, "digest": digest}
            if enc.entry["kind"] != "full":
                entry["base_digest"] = self._digests[name]
            entries[name] = entry
            arrays.extend(enc.arrays)
            changed_total += enc.changed
            self._all_full &= enc.entry["kind"] == "full"
            self._advance_base(name, t, base, enc.idx, digest)
        if self._full:
            meta_kind, base_version = "full", None
        else:
            meta_kind, base_version = "delta", self.base_version
        body_size = packed_size(arrays)
        body = pack(arrays, out=alloc(body_size) if alloc is not None else None)
        self._sync_bytes += body.numel()
        meta = {"format": FORMAT, "kind": meta_kind, "version": self._pending,
                "base_version": base_version, "tensors": entries, "changed_elements": changed_total}
        return Payload(bucket.index, bucket.last, self.name, bucket.digest(), bucket.specs(), body, meta)

    def _advance_base(self, name: str, new: torch.Tensor, base: torch.Tensor | None,
                      idx: torch.Tensor | None, digest: str) -> None:
        """Move the kept version forward in place; remember how to undo it."""
        assert self._base is not None
        old_digest = self._digests.get(name)
        same = base is not None and tuple(base.shape) == tuple(new.shape) and base.dtype == new.dtype
        if same and idx is not None:
            bb, i = bits(base).numpy(), idx.numpy()                  # numpy: faster scatters
            self._undo[name] = ("patch", idx, torch.from_numpy(bb[i]), old_digest)
            bb[i] = bits(new).numpy()[i]
        else:                     # whole tensor: the old one is the undo, the base gets a copy
            self._undo[name] = ("replace", base, old_digest)
            self._base[name] = new.clone()
        self._digests[name] = digest

    def commit(self, version: int) -> None:
        if self._pending is None or version != self._pending:
            return                       # receiver side, or a version this encoding did not stage
        if self._full or self._all_full:      # a version of only whole tensors is a full one
            self._last_full = version
            self._chain_bytes = 0
            self._full_bytes = sum(t.numel() * t.element_size() for t in (self._base or {}).values())
        else:
            self._chain_bytes += self._sync_bytes
        self.base_version = version
        self._pending = None
        self._undo = {}

    def rollback(self) -> None:
        if self._base is None:
            return
        for name, u in self._undo.items():
            if u[0] == "patch":
                _, idx, old, digest = u
                bits(self._base[name]).numpy()[idx.numpy()] = old.numpy()
            else:
                _, old, digest = u
                if old is None:
                    self._base.pop(name, None)
                else:
                    self._base[name] = old
            if digest is None:
                self._digests.pop(name, None)
            else:
                self._digests[name] = digest
        self._undo = {}
        self._pending = None
        if not self._base:
            self._base = None

    # -- receiver side ----------------------------------------------------------------------
    def receiving(self, engine_version: int) -> None:
        self._engine_version = engine_version

    def decode(self, payload: Payload, current: Callable[[str], torch.Tensor | None]
               ) -> list[tuple[str, torch.Tensor]]:
        return decode_payload(payload.meta, payload.body, [(s.name, s.dtype, list(s.shape)) for s in payload.specs],
                              current, self._engine_version)


def fused_digests(bucket: Bucket, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Per-tensor digests (for the manifest) and the bucket's digest (for the receiver), in one
    read of the bytes: each cache-sized chunk feeds both hashes."""
    import xxhash

    from weightsync.bucket import dtype_name, tensor_bytes
    whole = xxhash.xxh3_128()
    out = {}
    step = 1 << 22
    for name, t in tensors:
        one = xxhash.xxh3_128()
        head = f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}\n".encode()
        whole.update(head)
        one.update(head)
        mv = tensor_bytes(t)
        for off in range(0, len(mv), step):
            chunk = mv[off: off + step]
            whole.update(chunk)
            one.update(chunk)
        out[name] = one.hexdigest()
    bucket._digest = whole.hexdigest()
    return out


def decode_payload(meta: dict[str, Any], body: torch.Tensor, specs: list[tuple[str, str, list[int]]],
                   current: Callable[[str], torch.Tensor | None], engine_version: int | None
                   ) -> list[tuple[str, torch.Tensor]]:
    """Apply one delta payload against `current` (the receiver's live tensors); nothing is
    modified, the new tensors are returned for the receiver to stage and verify."""
    if meta.get("format") != FORMAT:
        raise PayloadError(f"payload is not a {FORMAT} payload (format {meta.get('format')!r})")
    if meta.get("kind") == "delta" and engine_version is not None \
            and meta.get("base_version") != engine_version:
        raise PayloadError(f"this delta was made against version {meta.get('base_version')}, but the "
                           f"engine holds version {engine_version}; it cannot be applied. Bring the "
                           f"engine to version {meta.get('base_version')} first, or restart the sender "
                           f"so its first sync is full")
    arrays = dict(unpack(body)[0])
    entries = meta.get("tensors") or {}
    out = []
    for name, dtype, shape in specs:
        entry = entries.get(name)
        if entry is None:
            raise PayloadError(f"tensor {name!r} has no delta entry in the payload's metadata")
        base = None if entry.get("kind") == "full" else current(name)
        if base is not None and entry.get("base_digest") \
                and digest_tensors([(name, base)]) != entry["base_digest"]:
            raise PayloadError(f"tensor {name!r}: the receiver's current tensor is not the base this "
                               f"delta was made against (version {meta.get('base_version')}); "
                               f"nothing was applied")
        new, _, _ = apply_entry(name, entry, arrays, base, dtype, shape)
        out.append((name, new))
    return out
