"""The Adapter: one engine's control protocol, its load paths, and the optional members for
rollouts, the probe and launching the engine."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from pydantic import BaseModel

from weightsync.errors import WeightSyncError
from weightsync.interfaces.sampling import Gate, Sample, SamplingParams, Unsupported
from weightsync.interfaces.base import Bounded, Component, Payload
from weightsync.interfaces.streams import Encoding, Endpoint, Transport

if TYPE_CHECKING:
    from weightsync.config import EngineSpec


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

    def payload_endpoint(self) -> Endpoint:
        raise NotImplementedError(f"adapter {self.name!r} has no HTTP payload endpoint")

    def relay_target(self) -> Endpoint | None:
        """Relay shapes of `http`: where a parent member posts this engine's frames (URL and
        round headers, never the API key); None: the engine takes payloads from the trainer only."""
        return None

    def expect(self, body: Mapping[str, Any]) -> None:
        """Relay shapes: tell the engine what a bucket that comes through a relay must be."""
        raise NotImplementedError(f"adapter {self.name!r} cannot take relayed payloads")

    def relay_answer(self, index: int, wait: float) -> Mapping[str, Any]:
        """Relay shapes: the engine's own outcome for relayed bucket `index` (signed with the
        key the trainer gave it), waiting up to `wait` seconds for it; asked over the engine's
        own channel, so no relay can hide or forge it."""
        raise NotImplementedError(f"adapter {self.name!r} cannot take relayed payloads")

    def relay_source(self) -> str | None:
        """Fetch relays of `http` (engines that fetch their bodies by reference): the URL of the
        body server where this engine offers the pieces it checked to the engines it feeds;
        None: it cannot pass bytes on this way."""
        return None

    def take_fetch(self, header: Mapping[str, Any], fetch: Mapping[str, Any]) -> None:
        """Fetch relays: hand the engine one payload to fetch by reference (`fetch`: url, token,
        nbytes, and under "relay" the piece digests, what to offer on, and the trainer's
        fallback copy); returns once it staged the payload."""
        raise NotImplementedError(f"adapter {self.name!r} cannot fetch relayed payloads")

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

    # -- optional: rollouts, the probe, launching (each raises Unsupported where not declared) ---
    sampling: ClassVar[frozenset[str]] = frozenset()
    """The `SamplingParams` fields this engine honours in `generate`; empty: it cannot generate
    through weightsync, and the rollout client refuses it before sending anything."""

    gates: ClassVar[bool] = False
    """True when `generate` waits on the engine itself for a version the gate admits (and
    refuses exact requests whose weights move); False: the client reads the version around it."""

    def generate(self, prompt: list[int], params: "SamplingParams", gate: "Gate") -> list["Sample"]:
        """`params.n` samples of `prompt`, each with the logprob of every sampled token and the
        version(s) it was computed with (`Sample.version`, `Sample.version_end`). Raises
        NotFitting (with the version held) when the engine holds no version `gate` admits, or
        when its weights changed under a request it cannot report per token."""
        raise Unsupported(f"adapter {self.name!r} cannot generate")

    def weight_version(self) -> int | None:
        """The version the engine serves now; None when it does not answer."""
        try:
            return self.health().version
        except WeightSyncError:
            return None

    scores: ClassVar[bool] = False
    """True when `score` works: the engine can score a given sequence (the probe after commit)."""

    def score(self, ids: list[int]) -> tuple[list[float], int]:
        """The logprob of each token of `ids` after the first, given the tokens before it, and
        the version that computed them: what the probe compares with the trainer's own."""
        raise Unsupported(f"adapter {self.name!r} cannot score a sequence")

    def busy_seconds(self) -> float | None:
        """Seconds the engine has spent generating since it started (an RL loop's idle
        fraction); None when the engine does not report it."""
        return None

    def distrust(self, version: int, reason: str) -> bool:
        """The probe failed on `version`: ask the engine to serve no gated request until a later
        version is committed. False: the engine cannot record it (the report still says so)."""
        return False

    @classmethod
    def start_command(cls, model: str, host: str, port: int, name: str,
                      options: dict[str, Any], env: dict[str, str], **extra: Any) -> list[str]:
        """The argv that starts this engine on `model` listening on host:port (Ray's engine
        actors). May add to `env` and `options` (a token the adapter must send). "{python}" in
        the argv stands for the node's interpreter; `extra` holds the launch's other fields
        (device, load_roots) for the engines that read them."""
        raise Unsupported(f"adapter {cls.name!r} has no start command; give the launch a `command`")

    @classmethod
    def launch_local(cls, model_dir: Path, workdir: Path, name: str,
                     extra_args: list[str] | None = None) -> "LocalEngine":
        """Start one engine on this machine serving `model_dir` (a Hugging Face model directory;
        `weightsync demo --engine KIND`); logs go under `workdir`; `extra_args` go to its
        command line."""
        raise Unsupported(f"adapter {cls.name!r} cannot start an engine on this machine")

    def close(self) -> None:
        """Release connections."""


@dataclass
class LocalEngine:
    """An engine `Adapter.launch_local` started: its config entry (url, api_key, name, adapter)
    and how to stop it."""

    spec: dict[str, Any]
    stop: Callable[[], None]
