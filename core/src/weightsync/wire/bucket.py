"""Buckets: the unit that flows. An ordered group of named tensors plus its digest."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch
import xxhash

from weightsync.wire.pool import map_threads

__all__ = ["Bucket", "DIGEST_ALGOS", "assign_buckets", "DTYPES", "TensorSpec", "combine_digests", "digest_algo",
           "digest_tensors", "dtype_from_name", "dtype_name", "pack", "pack_owned", "tensor_bytes",
           "tensor_digest", "tensor_hasher", "tensor_header"]

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2")}


def dtype_name(dtype: torch.dtype) -> str:
    """Bare torch name ("bfloat16"), the form every engine protocol uses."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPES)}") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # numpy's stubs give ndarray __buffer__ only on Python 3.12+
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def tensor_header(name: str, t: torch.Tensor) -> bytes:
    """What a tensor's digest hashes before its bytes: its name, dtype and shape."""
    return f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}\n".encode()


def tensor_hasher(name: str, t: torch.Tensor) -> xxhash.xxh3_128:
    """An xxh3-128 state that has taken `tensor_header`; fed the tensor's bytes in order (at
    once or in chunks), its hexdigest is `tensor_digest`."""
    return xxhash.xxh3_128(tensor_header(name, t))


DIGEST_ALGOS = ("xxh3", "mlh")


def digest_algo(digest: str) -> str:
    """Which algorithm made `digest`: `mlh:`-prefixed digests are mlh, bare hex is xxh3."""
    from weightsync.wire.mlh import PREFIX
    return "mlh" if digest.startswith(PREFIX) else "xxh3"


def tensor_digest(name: str, t: torch.Tensor, algo: str = "xxh3") -> str:
    """xxh3-128 over one tensor's name, dtype, shape and bytes; with `algo="mlh"` the device-side
    digest of `weightsync.wire.mlh` (no host copy of a CUDA tensor)."""
    if algo == "mlh":
        from weightsync.wire.mlh import mlh_digest
        return mlh_digest(tensor_header(name, t), t)
    if algo != "xxh3":
        raise ValueError(f"unknown digest algorithm {algo!r}; known: {list(DIGEST_ALGOS)}")
    h = tensor_hasher(name, t)
    h.update(tensor_bytes(t))
    return h.hexdigest()


def combine_digests(digests: Sequence[str]) -> str:
    """A group's digest from its tensors' digests, in order (one tensor: its own digest)."""
    if len(digests) == 1:
        return digests[0]
    joined = xxhash.xxh3_128("".join(digests).encode()).hexdigest()
    return joined if digest_algo(digests[0]) == "xxh3" else digests[0][:4] + joined


def digest_tensors(named: Iterable[tuple[str, torch.Tensor]], algo: str | None = None) -> str:
    """Equal digests mean bit-equal tensors (names, dtypes, shapes, bytes). Defined over the
    per-tensor digests so the tensors hash in parallel, and so a sender that already has each
    tensor's digest gets the group's for free. `algo` None: mlh when the tensors are on a GPU
    (hashed there), else xxh3; a receiver passes the algorithm of the digest it checks."""
    named = list(named)
    if algo is None:
        algo = "mlh" if any(t.device.type != "cpu" for _, t in named) else "xxh3"
    if algo == "mlh":       # GPU kernels queue on one stream: one call, one host sync
        from weightsync.wire.mlh import mlh_digests
        return combine_digests(mlh_digests([(tensor_header(n, t), t) for n, t in named]))
    return combine_digests(map_threads(lambda nt: tensor_digest(*nt), named))


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver must know to rebuild one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtype_from_name(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name, dtype_name(t.dtype), tuple(t.shape))


@dataclass
class Bucket:
    """An ordered group of named tensors of at most `bucket_bytes` (one oversized tensor travels
    alone). `last` marks the final bucket of a sync."""

    index: int
    tensors: list[tuple[str, torch.Tensor]]
    last: bool = False
    _digest: str | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.tensors]

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec.of(n, t) for n, t in self.tensors]

    def digest(self) -> str:
        """Computed once, then cached: the sender hashes each bucket exactly one time."""
        if self._digest is None:
            self._digest = digest_tensors(self.tensors)
        return self._digest

    def set_digest(self, digest: str) -> None:
        """For an encoding that hashed every tensor while it encoded them: the bucket's digest
        (`combine_digests` of the tensors' digests, in order), so nobody hashes the bucket twice."""
        self._digest = digest

    def with_tensors(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> Bucket:
        return Bucket(self.index, list(tensors), self.last)


def pack(named: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[Bucket]:
    """Named tensors as Buckets of at most `limit` bytes, in order (a tensor larger than `limit`
    travels alone), the last one marked; a name seen twice is refused (an exporter's name map
    that sends two tensors under one name)."""
    current: list[tuple[str, torch.Tensor]] = []
    size = index = 0
    names: set[str] = set()
    for name, t in named:
        if name in names:
            raise ValueError(f"two tensors map to the name {name!r}; fix the name map")
        names.add(name)
        n = t.numel() * t.element_size()
        if current and size + n > limit:
            yield Bucket(index, current)   # a tensor follows, so this one is not the last
            index += 1
            current, size = [], 0
        current.append((name, t))
        size += n
    if current:
        yield Bucket(index, current, last=True)


def assign_buckets(entries: Sequence[tuple[int, str, int]], limit: int) -> list[tuple[int, list[str]]]:
    """A push that several ranks send (`sync.senders: all`): (owner rank, name, nbytes) of every
    tensor, in export order, to the buckets of the whole push, each (owner, names). Each owner's
    tensors are packed as `pack` packs them; owners follow in rank order, so bucket numbers are
    0..N-1 across the ranks and the last one ends the push, whoever sends it. Every rank computes
    the same layout from the same metadata, so no bucket number is ever agreed over the wire."""
    out: list[tuple[int, list[str]]] = []
    for owner in sorted({o for o, _, _ in entries}):
        size = 0
        current: list[str] = []
        for o, name, n in entries:
            if o != owner:
                continue
            if current and size + n > limit:
                out.append((owner, current))
                current, size = [], 0
            current.append(name)
            size += n
        if current:
            out.append((owner, current))
    return out


def pack_owned(named: Iterable[tuple[str, torch.Tensor]], buckets: Sequence[tuple[int, list[str]]],
               me: int) -> Iterator[Bucket]:
    """The buckets of `assign_buckets` that rank `me` owns, filled from `named` (this rank's tensors in
    export order, others' skipped), under their global numbers."""
    mine = [(i, names) for i, (owner, names) in enumerate(buckets) if owner == me]
    it = iter(named)
    try:
        for index, names in mine:
            tensors: list[tuple[str, torch.Tensor]] = []
            for want in names:
                for name, t in it:
                    if name == want:
                        tensors.append((name, t))
                        break
                else:
                    raise ValueError(f"bucket {index}: tensor {want!r} was planned and never "
                                     f"exported; the export differs from its plan")
            yield Bucket(index, tensors, last=index == len(buckets) - 1)
        for _ in it:        # the rest of the export: its gathers may need this rank
            pass
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()         # stopped early: a sharded export still serves the other ranks
