"""Schemas (pydantic) of everything an agent reads: the published `latest` pointer and
`manifest.json`, and the host-local `state.json`. A file from a shared root is validated against
these before anything it names is read, so a badly typed field is one clear error up front, never
an exception deep inside an apply. Unknown fields are ignored (the format string gates meaning)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationError,
                      field_validator, model_validator)

from weightsync.wire.bucket import DTYPES

MANIFEST_FORMAT = "weightsync-disk-delta/2"      # 2: sparse positions may be gap-coded ("pos")
READABLE_FORMATS = ("weightsync-disk-delta/1", MANIFEST_FORMAT)

MAX_TENSOR_BYTES = 1 << 46        # 64 TiB: beyond any tensor, below any overflow in offsets
MAX_SHARD_BYTES = 1 << 46
MAX_TENSORS = 1 << 20
MAX_SHARDS = 1 << 16
MAX_DIMS = 8
_NAME_BAD = re.compile(r"[\x00-\x1f\x7f/\\]|\.\.|::")

ITEMSIZE: dict[str, int] = {n: d.itemsize for n, d in DTYPES.items()}

Digest128 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
Count = Annotated[int, Field(strict=True, ge=0)]
Dim = Annotated[int, Field(strict=True, ge=0, le=MAX_TENSOR_BYTES)]
if TYPE_CHECKING:
    DtypeName = str                 # a Literal of DTYPES' names, built at run time
else:
    DtypeName = Literal[tuple(DTYPES)]
ShardFile = Annotated[str, StringConstraints(pattern=r"^shard-\d{5}\.safetensors$")]
LocalFile = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,200}$")]


def check_name(name: str) -> str:
    """A tensor name as a manifest may carry it: no path separators, no `..`, no `::` (the
    separator of a delta's array names), no control characters, at most 1024 characters."""
    if not name or len(name) > 1024 or _NAME_BAD.search(name):
        raise ValueError(f"tensor name {name!r} is not allowed (empty, too long, or holds '/', "
                         f"'\\\\', '..', '::' or a control character)")
    return name


def numel_of(shape: list[int]) -> int:
    return math.prod(shape)


class _Tensor(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    dtype: DtypeName
    shape: Annotated[list[Dim], Field(max_length=MAX_DIMS)]

    @property
    def numel(self) -> int:
        return numel_of(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @model_validator(mode="after")
    def _size(self) -> _Tensor:
        if self.nbytes > MAX_TENSOR_BYTES:
            raise ValueError(f"shape {self.shape} of {self.dtype} is larger than any tensor "
                             f"({self.nbytes} bytes)")
        return self


class TensorEntry(_Tensor):
    """One tensor of a published version: how it travels and what it must end as."""
    shard: ShardFile
    kind: Literal["full", "sparse", "xor"]
    digest: Digest128                       # xxh3-128 of the tensor as the engine must end with it
    base_digest: Digest128 | None = None    # of the tensor this delta was made against
    pos: Literal["idx", "gap8", "gap16"] = "idx"
    changed: Count | None = None

    def coding(self) -> dict[str, Any]:
        """The fields codec.entry_changes reads."""
        return {"kind": self.kind, "pos": self.pos}


class ShardEntry(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    file: ShardFile
    bytes: Annotated[int, Field(strict=True, ge=8, le=MAX_SHARD_BYTES)]
    xxh3: Digest128


class Manifest(BaseModel):
    """A published version: `manifest.json` of `versions/vNNNNNNNN`."""
    model_config = ConfigDict(extra="ignore", frozen=True)
    format: Literal[READABLE_FORMATS]  # type: ignore[valid-type]
    version: Count
    kind: Literal["full", "delta"]
    base_version: Count | None = None
    shards: Annotated[list[ShardEntry], Field(max_length=MAX_SHARDS)]
    tensors: Annotated[dict[str, TensorEntry], Field(max_length=MAX_TENSORS)]

    @field_validator("tensors")
    @classmethod
    def _names(cls, v: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
        for name in v:
            check_name(name)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        files = [s.file for s in self.shards]
        if len(set(files)) != len(files):
            raise ValueError("a shard file is listed twice")
        known = set(files)
        for name, t in self.tensors.items():
            if t.shard not in known:
                raise ValueError(f"tensor {name!r} is in shard {t.shard!r}, which the shard list "
                                 f"does not have")
        if self.kind == "delta":
            if self.base_version is None or self.base_version >= self.version:
                raise ValueError(f"a delta needs a base version below its own version "
                                 f"{self.version} (has {self.base_version!r})")
        else:
            partial = sorted(n for n, t in self.tensors.items() if t.kind != "full")
            if partial:
                raise ValueError(f"a full version holds delta entries (tensors {partial[:3]})")
        return self

    def shard_tensors(self, file: str) -> dict[str, TensorEntry]:
        return {n: t for n, t in self.tensors.items() if t.shard == file}


class LatestPointer(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    version: Count
    dir: str

    @model_validator(mode="after")
    def _dir(self) -> LatestPointer:
        want = f"versions/v{self.version:08d}"
        if self.dir != want:
            raise ValueError(f"dir {self.dir!r} does not match version {self.version} ({want!r})")
        return self


class LocalTensor(_Tensor):
    file: LocalFile
    offset: Count
    digest: Digest128


class LocalState(BaseModel):
    """`state.json` of a host-local data directory."""
    model_config = ConfigDict(extra="ignore", frozen=True)
    version: Count
    tensors: dict[str, LocalTensor]


def explain(e: ValidationError, limit: int = 3) -> str:
    """A ValidationError in one line: where, what, and what was found."""
    errs = e.errors(include_url=False)
    parts = []
    for err in errs[:limit]:
        loc = ".".join(str(x) for x in err["loc"]) or "the document"
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        parts.append(f"{loc}: {err['msg']} (found {got})")
    if len(errs) > limit:
        parts.append(f"and {len(errs) - limit} more")
    return "; ".join(parts)
