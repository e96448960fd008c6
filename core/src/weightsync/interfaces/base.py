"""What every component is: a class with a `name` (what users type in config) and a pydantic
`Options` model; and the Payload, the unit a transport carries."""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping

import torch
from pydantic import BaseModel, ConfigDict

from weightsync.wire.bucket import TensorSpec
from weightsync.wire.frame import is_int
from weightsync.errors import PayloadError

NameMap = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]

Alloc = Callable[[int], torch.Tensor]   # nbytes -> a uint8 buffer the payload is written into


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Bounded:
    """Something whose waits must end by the push's deadline (set by the pipeline per push)."""

    deadline: float | None = None        # time.monotonic() by which the push must be over

    def bounded(self, seconds: float) -> float:
        """`seconds`, cut to what is left before the deadline (at least 0.05 s: fails fast)."""
        left = None if self.deadline is None else self.deadline - time.monotonic()
        return seconds if left is None else max(0.05, min(seconds, left))


class Component(abc.ABC):
    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, options: BaseModel | None = None) -> None:
        # typed Any: each kind's subclass reads the fields of its own `Options` model
        self.options: Any = options if options is not None else self.Options()

    @classmethod
    def describe(cls, options: BaseModel) -> dict[str, Any]:
        """The JSON that lets another process build the same component (never a live object)."""
        return {"kind": cls.name, "options": options.model_dump(mode="json")}


@dataclass
class Payload:
    """One encoded bucket: a JSON-able header and a uint8 body."""

    index: int
    last: bool
    encoding: str
    digest: str                      # xxh3-128 of the tensors the engine must end with
    specs: list[TensorSpec]          # those tensors
    body: torch.Tensor               # uint8, contiguous, CPU or CUDA
    meta: dict[str, Any] = field(default_factory=dict)
    sig: str | None = None           # HMAC of what the header claims (weightsync.wire.signing)

    @property
    def logical_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def wire_bytes(self) -> int:
        return self.body.numel()

    def header(self, **transport: Any) -> dict[str, Any]:
        h = {"index": self.index, "last": self.last, "encoding": self.encoding,
             "digest": self.digest, "tensors": [s.to_json() for s in self.specs],
             "nbytes": self.wire_bytes, "meta": self.meta}
        if self.sig is not None:
            h["sig"] = self.sig
        if transport:
            h["transport"] = transport
        return h

    @classmethod
    def from_header(cls, header: Mapping[str, Any], body: torch.Tensor) -> "Payload":
        """The payload a received JSON header describes, every field's type checked."""
        def bad(what: str) -> PayloadError:
            return PayloadError(f"payload header: {what}; the payload is malformed or corrupted")
        if not isinstance(header, Mapping):
            raise bad("not a JSON object")
        index, last, tensors = header.get("index"), header.get("last"), header.get("tensors")
        if not is_int(index) or index < 0:
            raise bad(f"'index' must be a non-negative integer, not {index!r}")
        if not isinstance(last, bool):
            raise bad(f"'last' must be true or false, not {last!r}")
        for key in ("encoding", "digest"):
            if not isinstance(header.get(key), str):
                raise bad(f"{key!r} must be a string, not {header.get(key)!r}")
        meta = header.get("meta") or {}
        if not isinstance(tensors, list) or not isinstance(meta, Mapping):
            raise bad("'tensors' must be a list and 'meta' an object")
        specs = []
        for t in tensors:
            if not (isinstance(t, Mapping) and isinstance(t.get("name"), str)
                    and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
                    and all(is_int(d) and d >= 0 for d in t["shape"])):
                raise bad(f"tensor entry {t!r} needs a string name and dtype and a shape of "
                          f"non-negative integers")
            specs.append(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])))
        return cls(index, last, header["encoding"], header["digest"], specs, body, dict(meta))
