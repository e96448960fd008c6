"""The Adapter: one engine's round protocol (health, pause, begin, deliver, end, commit, resume,
abort). What a transport needs on the engine side travels as that transport's messages through
`deliver`; what else an engine can do is a capability type (`weightsync.interfaces.capabilities`);
rollouts and launching are other interfaces (a sampler the RL application defines, `Launcher`)."""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping

import requests

from pydantic import BaseModel

from weightsync.errors import WeightSyncError
from weightsync.interfaces.base import Bounded, Component, Payload
from weightsync.interfaces.messages import Message
from weightsync.interfaces.streams import Encoding, Transport
from weightsync.net.client import auth_headers, call, session_for

if TYPE_CHECKING:
    from weightsync.config import EngineSpec


@dataclass
class EngineStatus:
    version: int
    paused: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Adapter(Bounded, Component):
    """Speaks one engine's control protocol, one instance per engine. `begin` opens the engine's one
    live round (where the engine supports it, a round id sent with every call, held under a lease
    the pipeline renews through `renew`); `end` returns digests; `commit` or `abort` closes it."""

    accepts: ClassVar[tuple[type[Message], ...] | None] = ()
    """The message types `deliver` carries (subclasses count); None: any message, because the
    engine runs weightsync's receiver, which passes each to the round's transport's receiving
    half. A transport whose `messages` are not all accepted is refused at config load."""
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
    """True when the engine takes `Announce` messages in their `seq` order itself (weightsync's
    receiver), so a transport may keep the next one in flight; otherwise it waits for each."""
    layout: ClassVar[str] = "safetensors"
    """What a group broadcast carries for this engine: "safetensors" (the whole payload body) or
    "flat" (only its data section: tensor bytes back to back, largest itemsize first, which is
    SGLang's flattened_bucket layout)."""

    def __init__(self, options: BaseModel | None = None, engine: "EngineSpec | None" = None) -> None:
        super().__init__(options)
        if engine is None:
            from weightsync.config import EngineSpec
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

    def deliver(self, message: Message) -> Mapping[str, Any]:
        """Carry one transport message to the engine (within the open round when there is one)
        and return its answer; which messages an adapter can carry: `accepts`."""
        raise WeightSyncError(f"adapter {self.name!r} takes no transport messages "
                              f"({message.kind!r} refused)")

    def close(self) -> None:
        """Release connections."""


class HttpAdapter(Adapter):
    """An adapter that talks HTTP to its engine, as every engine adapter does: one session (with the
    engine's TLS verification), the API key as a bearer header, the base URL, and `request`, raising
    EngineUnreachable / EngineUnavailable / EngineError in the engine's own words."""

    def __init__(self, options: BaseModel | None = None, engine: "EngineSpec | None" = None) -> None:
        super().__init__(options, engine)
        self.session = session_for(self.engine)
        self.headers = auth_headers(self.engine.api_key)
        self.base = self.engine.url.rstrip("/")

    def request(self, method: str, path: str, *, timeout: float | None = None,
                ok: Iterable[int] = (200,), headers: Mapping[str, str] | None = None,
                push: bool = True, **kwargs: Any) -> requests.Response:
        """One call to `base + path`; `timeout` defaults to the adapter's `timeout` option and,
        for a call of a push (`push`), is cut to the push's deadline (a rollout's call is not);
        `headers` add to the key's; `kwargs` go to requests (json, params, data)."""
        seconds = timeout if timeout is not None else getattr(self.options, "timeout", 30.0)
        return call(self.session, self.engine_name, method, self.base + path,
                    timeout=self.bounded(seconds) if push else seconds, ok=ok,
                    headers={**self.headers, **(headers or {})}, **kwargs)

    def close(self) -> None:
        self.session.close()


class AckedRound:
    """The round of an engine that cannot hash what it loaded (`verification = "ack"`): the sender's
    digest of each bucket it acknowledged in full, for `end` to return, so a bucket it refused or
    never answered fails it. Thread-safe: broadcasts are acknowledged on their own threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: dict[int, str] = {}

    def ack(self, index: int, digest: str) -> None:
        with self._lock:
            self._digests[int(index)] = str(digest)

    def digests(self) -> dict[int, str]:
        with self._lock:
            return dict(self._digests)

    def reset(self) -> int:
        """Forget the round; returns how many buckets the engine had loaded (a mix of versions)."""
        with self._lock:
            n, self._digests = len(self._digests), {}
        return n
