"""The four component kinds. A component is a class with a `name` (what users type in config) and
a pydantic `Options` model; the orchestrator builds it from config and calls it directly."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict

from .bucket import Bucket, TensorSpec

if TYPE_CHECKING:
    from .config import EngineSpec

NameMap = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
Alloc = Callable[[int], torch.Tensor]   # nbytes -> a uint8 buffer the payload is written into


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Component(abc.ABC):
    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options if options is not None else self.Options()

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
        if transport:
            h["transport"] = transport
        return h

    @classmethod
    def from_header(cls, header: Mapping[str, Any], body: torch.Tensor) -> "Payload":
        specs = [TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in header["tensors"]]
        return cls(int(header["index"]), bool(header["last"]), str(header["encoding"]),
                   str(header["digest"]), specs, body, dict(header.get("meta") or {}))


class Exporter(Component):
    """Turns a model into a stream of Buckets under Hugging Face names."""

    @abc.abstractmethod
    def buckets(self, model: Any, *, name_map: NameMap | None = None) -> Iterator[Bucket]: ...


class Encoding(Component):
    """Turns a Bucket into a Payload and back. Stateful encodings (delta) hear whether a sync
    landed through begin/commit/rollback."""

    lossless: ClassVar[bool] = True

    @abc.abstractmethod
    def encode(self, bucket: Bucket, alloc: Alloc | None = None) -> Payload:
        """`alloc(nbytes)`, when given, returns the buffer to write the body into."""

    @abc.abstractmethod
    def decode(self, payload: Payload,
               current: Callable[[str], torch.Tensor | None]) -> list[tuple[str, torch.Tensor]]:
        """Rebuild the target tensors; `current(name)` gives the engine's live tensor (delta base)."""

    def begin(self, version: int) -> None:
        """A sync to `version` starts."""

    def commit(self, version: int) -> None:
        """The sync to `version` landed on every engine."""

    def rollback(self) -> None:
        """The sync failed; forget anything staged for it."""

    def receiving(self, engine_version: int) -> None:
        """Receiver side, before any decode: the version the engine holds now, so an encoding
        whose payloads are made against a base version (delta) can refuse any other base."""


Render = Callable[[dict[str, Any], torch.Tensor], tuple[list[Any], str]]


@dataclass
class Endpoint:
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float = 60.0
    render: Render | None = None
    """Builds (body parts, content type) from the payload header and body, for an engine route
    that takes another body than weightsync's frame (vLLM's JSON /update_weights); None: the frame."""


class TransportReceiver(abc.ABC):
    """The receiving half of a transport, built inside the engine process from `describe()`."""

    def __init__(self, options: BaseModel) -> None:
        self.options = options

    def join(self, info: Mapping[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not join groups")

    @abc.abstractmethod
    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        """Return the payload body (uint8) for `header`; `body` is set when it came in-band."""

    def release(self, header: Mapping[str, Any]) -> None:
        """The engine is done with the body of `header` (the sender may reuse its buffer)."""

    def close(self) -> None:
        """Release every resource (segments, groups)."""


class Transport(Component):
    """Carries payloads from the sender to every engine. `requires` names the adapter capability
    it uses to reach the engine: "http" (payload POSTed to an endpoint the adapter gives),
    "announce" (bytes placed out of band, the adapter announces them), "group" (a collective
    group the adapter asks the engine to join)."""

    requires: ClassVar[str] = "http"
    same_host: ClassVar[bool] = False
    publish_only: ClassVar[bool] = False
    """True for transports that publish for receivers to pull (disk_delta): the pipeline then
    pauses no engine and verifies nothing itself; the pullers check every digest."""
    receiver: ClassVar[type[TransportReceiver] | None] = None

    def open(self, engines: Sequence["Adapter"], version: int) -> dict[str, BaseException]:
        """Prepare for one sync (segments, group). Returns the engines that could not be reached."""
        return {}

    @abc.abstractmethod
    def send(self, payload: Payload, engines: Sequence["Adapter"]) -> dict[str, BaseException]:
        """Deliver `payload` to every engine; return the failures by engine name."""

    def finish(self, engines: Sequence["Adapter"]) -> dict[str, BaseException]:
        """Wait until every engine holds every payload."""
        return {}

    alloc: Alloc | None = None
    """Set by transports that want payloads written into their own buffers (shared memory)."""

    def discard(self, payload: Payload) -> None:
        """`payload` will not be sent (its sync is being abandoned): release its buffer."""

    def close(self) -> None:
        """Release everything the transport holds (groups, segments); called at shutdown."""


@dataclass
class EngineStatus:
    version: int
    paused: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Adapter(Component):
    """Speaks one engine's control protocol. One instance per engine."""

    capabilities: ClassVar[frozenset[str]] = frozenset()
    encodings: ClassVar[frozenset[str] | None] = None   # None: weightsync's receiver decodes any
    pause_modes: ClassVar[tuple[str, ...]] = ("abort", "keep")
    ordered_announces: ClassVar[bool] = False
    """True when the engine serves announces in their `seq` order itself (weightsync's receiver),
    so a transport may keep the next one in flight; otherwise it waits for each to finish."""
    layout: ClassVar[str] = "safetensors"
    """What a group broadcast carries for this engine: "safetensors" (the whole payload body) or
    "flat" (only its data section: tensor bytes back to back, largest itemsize first, which is
    SGLang's flattened_bucket layout)."""

    def __init__(self, options: BaseModel | None = None, engine: "EngineSpec | None" = None) -> None:
        super().__init__(options)
        if engine is None:
            from .config import EngineSpec
            engine = EngineSpec(url="http://127.0.0.1:8100")
        self.engine = engine

    @property
    def engine_name(self) -> str:
        return self.engine.name or self.engine.url

    @classmethod
    def check(cls, options: BaseModel, transport: type[Transport], encoding: type[Encoding]) -> None:
        """Refuse a combination this engine cannot do; raise ConfigError saying what works."""

    @abc.abstractmethod
    def health(self) -> EngineStatus: ...

    @abc.abstractmethod
    def pause(self, mode: str) -> None: ...

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def begin(self, version: int, plan: Mapping[str, Any]) -> None:
        """Open an update round. `plan` carries the transport's and encoding's `describe()`."""

    @abc.abstractmethod
    def end(self) -> dict[int, str]:
        """Close the round; return the engine's digest of every bucket it staged."""

    @abc.abstractmethod
    def commit(self, version: int) -> None:
        """Make the staged weights live and set the weight version."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop whatever was staged; the engine stays at its previous version."""

    def payload_endpoint(self) -> Endpoint:
        raise NotImplementedError(f"adapter {self.name!r} has no HTTP payload endpoint")

    def announce(self, header: Mapping[str, Any]) -> None:
        raise NotImplementedError(f"adapter {self.name!r} cannot announce out-of-band payloads")

    def group_size(self) -> int:
        """Ranks this engine contributes to a collective group (its TP size)."""
        return 1

    def join_group(self, info: Mapping[str, Any]) -> None:
        """Blocking: the engine joins the trainer's group. `info` is SGLang's init body:
        master_address, master_port, rank_offset, world_size, group_name, backend."""
        raise NotImplementedError(f"adapter {self.name!r} cannot join a collective group")

    def load_from_disk(self, path: str, version: int) -> None:
        """Capability "disk": reload every weight from a local safetensors checkpoint directory
        and set `version` (disk_delta's pull agent calls this)."""
        raise NotImplementedError(f"adapter {self.name!r} cannot reload from disk")

    def leave_group(self, info: Mapping[str, Any]) -> None:
        """Best effort: ask the engine to destroy the group."""

    def close(self) -> None:
        """Release connections."""
