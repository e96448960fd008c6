"""Where a push's members come from (Fleet); how a joiner fetches a peer's weights (PeerSource),
and how a member serves them when the bytes do not travel over its own HTTP routes (PeerHosting)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from weightsync.interfaces.base import Component

if TYPE_CHECKING:
    import torch

    from weightsync.config import EngineSpec


@dataclass
class Member:
    """An engine a push must reach: its name and adapter spec (from its registration or config)."""

    name: str
    spec: "EngineSpec"                          # url, api_key, adapter kind and options
    version: int | None = None                  # last version the fleet heard of (None: unknown)
    info: dict[str, Any] = field(default_factory=dict)


class Fleet(Component):
    """Where the members of a sync come from: asked at every push, told what it did."""

    takes_engines: ClassVar[bool] = False
    """True when the fleet is (or starts from) the config's `engines:` list."""
    url: str | None = None
    """Where members register (a registry fleet); None for fleets members do not join."""

    def open(self, components: Any, default_adapter: Any) -> None:
        """Start what the fleet runs; `default_adapter` is for members that name none."""

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
    """How a joining member fetches a current member's weights: a JSON manifest and one payload per
    bucket (HTTP built in; a plugin may carry bytes another way under another source name)."""

    @abc.abstractmethod
    def manifest(self, peer: Mapping[str, Any]) -> dict[str, Any]:
        """The peer's manifest. `peer` is what the registry handed out: url, token, source."""

    @abc.abstractmethod
    def bucket(self, peer: Mapping[str, Any], index: int) -> tuple[dict[str, Any], memoryview]:
        """One payload: its header (index, last, encoding, digest, tensors, nbytes, version) and body."""

    def hosting(self) -> "PeerHosting":
        """This source's serving half, for a member that serves joiners through it. HTTP, the
        built-in source, needs none (the engine's own routes serve); a source that moves bytes
        another way (registered memory for RDMA) returns a PeerHosting."""
        from weightsync.errors import ConfigError
        raise ConfigError(f"peer source {self.name!r} has no serving half: a member serves "
                          f"joiners through it only where it returns one from hosting()")


class PeerHosting(abc.ABC):
    """A peer source's serving half inside a member: it holds one version where joiners read it
    (memory registered with a transfer engine, say). The member publishes its current weights
    when a share asks for a version the hosting does not hold, and withdraws them when it moves
    on, so a joiner never reads a version the member no longer holds."""

    version: int | None = None
    """The version published now (None: nothing is served)."""

    @abc.abstractmethod
    def publish(self, version: int, named: Mapping[str, "torch.Tensor"]) -> None:
        """Serve `named` as `version` from now on (what served an older version goes)."""

    @abc.abstractmethod
    def share(self, token: str, ttl: float) -> dict[str, Any]:
        """Let the joiner holding `token` read the published version once within `ttl` seconds;
        returns {"version", "source"}, as `SharesWeights.share` does."""

    @abc.abstractmethod
    def manifest(self, token: str | None) -> dict[str, Any]:
        """What the joiner's manifest call (`GET /weightsync/peer/manifest`) returns: this
        source's peer side parses it."""

    @abc.abstractmethod
    def withdraw(self) -> None:
        """Stop serving the published version: a read of it fails from now on."""

    def health(self) -> dict[str, Any]:
        """What the member's health shows of this hosting (reads served, say)."""
        return {"version": self.version}

    def close(self) -> None:
        """Withdraw and release what the hosting holds."""
        self.withdraw()
