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
        """The serving half, for a member that serves joiners through this source (HTTP needs
        none: the engine's own routes serve)."""
        from weightsync.errors import ConfigError
        raise ConfigError(f"peer source {self.name!r} has no serving half (hosting())")


class PeerHosting(abc.ABC):
    """A peer source's serving half inside a member: holds one version where joiners read it
    (registered memory, say). The member publishes what it holds when a share asks for another
    version, and withdraws it whenever its weights change: no joiner reads a version gone."""

    version: int | None = None                  # published now (None: nothing)

    @abc.abstractmethod
    def publish(self, version: int, named: Mapping[str, "torch.Tensor"]) -> None:
        """Serve `named` as `version` from now on."""

    @abc.abstractmethod
    def share(self, token: str, ttl: float) -> dict[str, Any]:
        """One read by `token` within `ttl` s; {"version", "source"} as `SharesWeights.share`."""

    @abc.abstractmethod
    def manifest(self, token: str | None) -> dict[str, Any]:
        """The answer to the joiner's `GET /weightsync/peer/manifest` (its source parses it)."""

    @abc.abstractmethod
    def withdraw(self) -> None:
        """Stop serving: a read of the published version fails from now on."""

    def health(self) -> dict[str, Any]:
        return {"version": self.version}

    def close(self) -> None:
        self.withdraw()
