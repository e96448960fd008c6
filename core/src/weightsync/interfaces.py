"""The four component kinds. A component is a class with a `name` (what users type in config) and
a pydantic `Options` model; the orchestrator builds it from config and calls it directly."""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict

from .bucket import Bucket, TensorSpec
from .errors import PayloadError

if TYPE_CHECKING:
    from .config import EngineSpec

NameMap = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
Alloc = Callable[[int], torch.Tensor]   # nbytes -> a uint8 buffer the payload is written into


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Bounded:
    """Something whose waits must end by the push's deadline (set by the pipeline per push)."""

    deadline: float | None = None        # time.monotonic() by which the push must be over

    def bounded(self, seconds: float) -> float:
        """`seconds`, cut to what is left before the deadline (at least 0.05 s, so a call that
        starts right at the deadline fails fast instead of not being made)."""
        if self.deadline is None:
            return seconds
        return max(0.05, min(seconds, self.deadline - time.monotonic()))


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
    sig: str | None = None           # HMAC of what the header claims (weightsync.signing)

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
        """The payload a received JSON header describes, every field's type checked (a header
        comes from the network: `true` is not bucket 1, `2.0` is not a dimension)."""
        def bad(what: str) -> PayloadError:
            return PayloadError(f"payload header: {what}; the payload is malformed or corrupted")
        if not isinstance(header, Mapping):
            raise bad("not a JSON object")
        index, last, tensors = header.get("index"), header.get("last"), header.get("tensors")
        if not _is_int(index) or index < 0:
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
                    and all(_is_int(d) and d >= 0 for d in t["shape"])):
                raise bad(f"tensor entry {t!r} needs a string name and dtype and a shape of "
                          f"non-negative integers")
            specs.append(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])))
        return cls(index, last, header["encoding"], header["digest"], specs, body, dict(meta))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Exporter(Component):
    """Turns a model into a stream of Buckets under Hugging Face names."""

    @abc.abstractmethod
    def buckets(self, model: Any, *, name_map: NameMap | None = None) -> Iterator[Bucket]: ...


class Encoding(Component):
    """Turns a Bucket into a Payload and back. Stateful encodings (delta) hear whether a sync
    landed through begin/commit/rollback."""

    lossless: ClassVar[bool] = True
    streams: ClassVar[bool] = False
    """True when the wire form is the target tensors in safetensors layout (raw, cast), so an
    engine may read an in-band body straight into staging (`ReceiveSession.apply_stream`)."""

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

    def base(self) -> int | None:
        """Sender side, after begin(): the version an engine must hold to apply this sync's
        payloads (a delta's base), or None when they apply to any version. Engines at another
        version are caught up with whole tensors in the same push."""
        return None


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

    private: ClassVar[bool] = False
    """True when `receive` returns this process's own memory (an HTTP body, a receive buffer):
    nobody else can change it, so it is hashed as it is copied into staging."""
    in_band: ClassVar[bool] = False
    """True when the body comes in the request itself (http), so a server may stream it into
    staging as it reads it."""

    def __init__(self, options: BaseModel) -> None:
        self.options = options

    def join(self, info: Mapping[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not join groups")

    def hash_source(self, header: Mapping[str, Any]) -> bool | None:
        """Whether the body of `header` may be hashed as it is read, though it is shared memory
        (the receiver checks it after the copy, `unchanged`); None: not supported, `private`
        decides."""
        return None

    def unchanged(self, header: Mapping[str, Any]) -> None:
        """After staging the body of `header`: raise PayloadError if the sender rewrote it
        meanwhile (for receivers whose `hash_source` vouched for it); by default nothing to
        check."""

    @abc.abstractmethod
    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        """Return the payload body (uint8) for `header`; `body` is set when it came in-band."""

    def release(self, header: Mapping[str, Any]) -> None:
        """The engine is done with the body of `header` (the sender may reuse its buffer)."""

    def close(self) -> None:
        """Release every resource (segments, groups)."""


class Transport(Bounded, Component):
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
    announce_ahead: Callable[[Payload, Sequence["Adapter"]], None] | None = None
    """Set by transports that tell engines about a payload as soon as it is packed, while the
    one before it is still moving (collective); None: `send` announces."""

    def discard(self, payload: Payload) -> None:
        """`payload` will not be sent (its sync is being abandoned): release its buffer."""

    def close(self) -> None:
        """Release everything the transport holds (groups, segments); called at shutdown."""


@dataclass
class EngineStatus:
    version: int
    paused: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Adapter(Bounded, Component):
    """Speaks one engine's control protocol. One instance per engine.

    Round protocol: `begin` opens the engine's one live round (engines that support it return a
    round id the adapter then sends with every call, and hold it under a lease the pipeline keeps
    alive through `renew`); `end` returns digests; `commit` or `abort` closes it."""

    capabilities: ClassVar[frozenset[str]] = frozenset()
    staging: ClassVar[bool] = True
    """True: the engine stages a whole round and applies it at commit, so it keeps generating
    during the transfer and is paused only around the swap. False: it applies as it receives
    (SGLang's and LMDeploy's own routes), so it is paused before the first payload."""
    verification: ClassVar[str] = "digest"
    """"digest": `end()` returns digests the engine computed over the bytes it staged.
    "ack": the engine only acknowledges; the outcome is `acknowledged` unless `confirm()` read
    back what the engine holds."""
    leases: ClassVar[bool] = False
    """True when the engine holds rounds and pauses under a lease that `renew` extends."""
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

    lease: float = 10.0
    """Seconds the engine keeps this trainer's round (and a pause it took) without renewal; set
    by the pipeline from `sync.lease`."""

    def renew(self) -> None:
        """Extend the lease of the open round and of a pause (engines with `leases`)."""

    def observe(self, payload: Payload) -> None:
        """Each payload sent to this engine, while its body is still valid: an acknowledging
        adapter keeps what `confirm` needs (a few sampled values)."""

    def confirm(self, version: int) -> bool:
        """After commit: check what the engine now holds against what was sent. True: checked
        and equal (the outcome is `verified`); False: not checked; raise on a mismatch."""
        return False

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

    def share(self, token: str, ttl: float) -> dict[str, Any]:
        """Capability "peer": let a joiner holding `token` pull this engine's current weights
        for `ttl` seconds; returns what the joiner needs besides url and token (the source)."""
        raise NotImplementedError(f"adapter {self.name!r} cannot serve its weights to peers")

    def pull(self, peer: Mapping[str, Any]) -> int:
        """Capability "pull": the engine fetches the current version from `peer` (url, token,
        source), checks every digest and commits it; returns the version it holds."""
        raise NotImplementedError(f"adapter {self.name!r} cannot pull from peers")

    def close(self) -> None:
        """Release connections."""


@dataclass
class Member:
    """One engine a fleet says a push must reach: a name, and the adapter spec built from its
    registration (or its config entry)."""

    name: str
    spec: "EngineSpec"                          # url, api_key, adapter kind and options
    version: int | None = None                  # last version the fleet heard of (None: unknown)
    info: dict[str, Any] = field(default_factory=dict)


class Fleet(Component):
    """Where the members of a sync come from: a static list, a registry members join at run
    time, Ray, a third party's Kubernetes. The pipeline asks it for the live members at the
    start of every push and tells it what the push did; nothing more."""

    takes_engines: ClassVar[bool] = False
    """True when the fleet is (or starts from) the config's `engines:` list."""
    url: str | None = None
    """Where members register (a registry fleet); None for fleets members do not join."""

    def open(self, components: Any, default_adapter: Any) -> None:
        """Start whatever the fleet runs (a registry service); `default_adapter` is the config's
        adapter reference for members that name none."""

    @abc.abstractmethod
    def members(self) -> list[Member]:
        """The members a push starting now must reach."""

    def excluded(self) -> dict[str, str]:
        """Known members that are not in `members()` right now, and why."""
        return {}

    def synced(self, version: int, versions: Mapping[str, int | None]) -> None:
        """A push of `version` ended; `versions` is what each member holds now."""

    def close(self) -> None:
        """Stop what `open` started."""


class PeerSource(Component):
    """How a joining member fetches a current member's weights: a JSON manifest (version,
    buckets with their tensors and digests) and one payload per bucket. HTTP is built in; a
    plugin can carry the bytes another way (RDMA) by registering its own source under another
    name, which peers then advertise."""

    @abc.abstractmethod
    def manifest(self, peer: Mapping[str, Any]) -> dict[str, Any]:
        """The peer's manifest. `peer` is what the registry handed out: url, token, source."""

    @abc.abstractmethod
    def bucket(self, peer: Mapping[str, Any], index: int) -> tuple[dict[str, Any], memoryview]:
        """One payload: its header (index, last, encoding, digest, tensors, nbytes, version) and body."""
