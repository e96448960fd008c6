"""The components that make and carry payloads: Exporter (model -> Buckets), Encoding (Bucket ->
payload and back) and Transport (payloads to every receiver), with its receiving half."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Mapping, Protocol, Sequence

import torch
from pydantic import BaseModel

from weightsync.wire.bucket import Bucket
from weightsync.errors import PayloadError
from weightsync.interfaces.base import Alloc, Bounded, Component, NameMap, Payload
from weightsync.interfaces.messages import Message

if TYPE_CHECKING:
    from weightsync.interfaces.adapter import Adapter


class Exporter(Component):
    """Turns a model into a stream of Buckets under Hugging Face names."""

    spreads: ClassVar[bool] = False
    """True when `owned` splits a push among the trainer's ranks (`sync.senders: all`)."""

    @abc.abstractmethod
    def buckets(self, model: Any, *, name_map: NameMap | None = None) -> Iterator[Bucket]: ...

    def owned(self, model: Any, *, name_map: NameMap | None = None) -> Iterator[Bucket]:
        """Every rank calls this: the buckets this rank sends itself, numbered in the whole
        push's order (`wire.bucket.assign_buckets`), so that the ranks' buckets together are the push."""
        raise NotImplementedError(f"exporter {self.name!r} cannot split a push among ranks")


class Encoding(Component):
    """Turns a Bucket into a Payload and back. Stateful encodings (delta) hear whether a sync
    landed through begin/commit/rollback."""

    lossless: ClassVar[bool] = True
    streams: ClassVar[bool] = False
    """True when the wire form is the target tensors in safetensors layout (raw, cast), so an
    engine may read an in-band body straight into staging (`ReceiveSession.apply_stream`)."""

    @abc.abstractmethod
    def encode(self, bucket: Bucket, alloc: Alloc | None = None) -> Payload:
        """`alloc(nbytes)`, when given, returns the buffer the body must be (or be a view of): the
        transport frees it when the payload is answered or discarded, so one taken and not
        shipped stays held until the next sync opens."""

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


class Stages(Protocol):
    """What a receiving half stages payloads into (the round's `ReceiveSession`)."""

    def apply(self, header: Mapping[str, Any], body: memoryview | None = None) -> str: ...


class TransportReceiver(abc.ABC):
    """The receiving half of a transport, built inside the engine process from `describe()`."""

    private: ClassVar[bool] = False
    """True when `receive` returns this process's own memory (an HTTP body, a receive buffer):
    nobody else can change it, so it is hashed as it is copied into staging."""
    in_band: ClassVar[bool] = False
    """True when the body comes in the request itself (http), so a server may stream it into
    staging as it reads it."""

    def __init__(self, options: BaseModel) -> None:
        # typed Any: each kind's receiver reads the fields of its own `Options` model
        self.options: Any = options

    def deliver(self, kind: str, body: Mapping[str, Any], session: Stages) -> dict[str, Any]:
        """One message from this transport's sending half (`Adapter.deliver`); returns the JSON
        answer. Here: an `Announce` is staged and answered with its digest; a transport with
        messages of its own overrides this and passes the rest up."""
        if kind == "announce":
            return {"digest": session.apply(body, None)}
        raise PayloadError(f"transport receiver {type(self).__name__} takes no message {kind!r}; "
                           f"is the engine's weightsync plugin for this transport the trainer's?")

    def hash_source(self, header: Mapping[str, Any]) -> bool | None:
        """Whether the body of `header` may be hashed as it is read, though it is shared memory
        (checked after the copy by `unchanged`); None: unsupported, `private` decides."""
        return None

    def unchanged(self, header: Mapping[str, Any]) -> None:
        """After staging the body of `header`: raise PayloadError if the sender rewrote it meanwhile
        (for receivers whose `hash_source` vouched for it); by default no check."""

    @abc.abstractmethod
    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        """Return the payload body (uint8) for `header`; `body` is set when it came in-band."""

    def release(self, header: Mapping[str, Any]) -> None:
        """The engine is done with the body of `header` (the sender may reuse its buffer)."""

    def close(self) -> None:
        """Release every resource (segments, groups)."""


class Transport(Bounded, Component):
    """Carries payloads from the sender to every engine. `requires` lists the capability types
    (weightsync.interfaces.capabilities) an adapter must have for this transport, `messages` the
    message types its sending half delivers (`Adapter.deliver`); the assembly refuses an adapter
    that lacks one, before anything moves."""

    requires: ClassVar[tuple[type, ...]] = ()
    messages: ClassVar[tuple[type[Message], ...]] = ()
    same_host: ClassVar[bool] = False
    publish_only: ClassVar[bool] = False
    """True for transports that publish for receivers to pull (disk_delta): the pipeline then
    pauses no engine and verifies nothing itself; the pullers check every digest."""
    receiver: ClassVar[type[TransportReceiver] | None] = None
    spreads: ClassVar[bool] = False
    """True when every trainer rank may send its own buckets through its own instance, into
    rounds rank 0 opened (`sync.senders: all`): nothing in it is shared between senders."""

    def open(self, engines: Sequence["Adapter"], version: int) -> dict[str, BaseException]:
        """Prepare for one sync (segments, group). Returns the engines that could not be reached."""
        return {}

    @abc.abstractmethod
    def send(self, payload: Payload, engines: Sequence["Adapter"]) -> dict[str, BaseException]:
        """Deliver `payload` to every engine; return the failures by engine name."""

    def finish(self, engines: Sequence["Adapter"]) -> dict[str, BaseException]:
        """Wait until every engine holds every payload."""
        return {}

    def relay_plan(self, engines: Sequence["Adapter"]) -> dict[str, list[str]] | None:
        """Relay shapes: each member's children among `engines` ({}: no one relays this time); the
        pipeline then catches engines that lack the encoding's base up from a peer. None: the
        trainer sends every engine its own copy (star), those engines' too."""
        return None

    def remarks(self) -> dict[str, str]:
        """What this push's transport noticed about engines beyond failures (a relay planned as
        a leaf after it stalled), by engine name; the report shows each."""
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
