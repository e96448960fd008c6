"""Capabilities an adapter may have beyond the round protocol, as types: a transport lists the
ones it needs in `Transport.requires`, and the assembly checks `issubclass(adapter, cap)` before
anything moves. Each is a `runtime_checkable` Protocol, so an adapter has one by implementing its
methods; nothing is registered and no string names it."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

from weightsync.interfaces.streams import Endpoint

__all__ = ["ChecksAccess", "Distrusts", "JoinsGroups", "PullsFromPeers", "RelaysFetches", "RelaysPayloads",
           "ReloadsFromDisk", "Scores", "ServesPayloads", "SharesRounds", "SharesWeights",
           "group_ranks"]


@runtime_checkable
class ChecksAccess(Protocol):
    """The adapter can check its credential with a call that changes nothing (`weightsync check`
    and `WeightSync.preflight` ask before a trainer loads its model)."""

    def check_access(self) -> None:
        """Raise EngineError saying what was refused (a missing or wrong key), else return."""


@runtime_checkable
class ServesPayloads(Protocol):
    """The engine takes payload bodies posted to an HTTP endpoint (transport `http`)."""

    def payload_endpoint(self) -> Endpoint:
        """Where a payload is POSTed (URL, round headers, timeout, an optional renderer)."""


@runtime_checkable
class RelaysPayloads(Protocol):
    """The engine passes the frames it receives on to other members (http's relay shapes); it
    takes the http transport's `ExpectRelay` and `RelayOutcome` messages."""

    def relay_target(self) -> Endpoint | None:
        """Where a parent member posts this engine's frames (URL and round headers, never the
        API key); None: this engine takes payloads from the trainer only."""


@runtime_checkable
class RelaysFetches(Protocol):
    """The engine fetches bodies by reference and offers the pieces it checked to the engines it
    feeds (http's fetch relays); it takes the http transport's `FetchPayload` message."""

    def relay_source(self) -> str | None:
        """The URL of the body server where the engine offers its pieces; None: not now."""


@runtime_checkable
class SharesRounds(Protocol):
    """Payloads from several trainer ranks can land in one round (`sync.senders: all`): rank 0
    opens the round, and each sending rank's adapter joins it with what rank 0's holds."""

    def round_state(self) -> dict[str, Any]:
        """What another process needs to send into the round this adapter opened (JSON)."""

    def join_round(self, state: Mapping[str, Any]) -> None:
        """Send into the round `state` (another adapter's `round_state`) names."""


@runtime_checkable
class JoinsGroups(Protocol):
    """The engine joins a collective group (transport `collective`)."""

    def group_size(self) -> int:
        """Ranks this engine contributes to the group (its TP size)."""


@runtime_checkable
class ReloadsFromDisk(Protocol):
    """The engine reloads every weight from a local safetensors checkpoint directory."""

    def load_from_disk(self, path: str, version: int, allow_older: bool = False,
                       signature: Mapping[str, Any] | None = None) -> None:
        """Reload `path` and set `version` (disk_delta's pull agent, an operator's rollback)."""


@runtime_checkable
class SharesWeights(Protocol):
    """The engine serves its current weights to a joining peer (peer join's source side)."""

    def share(self, token: str, ttl: float) -> dict[str, Any]:
        """Let a joiner holding `token` pull the current weights for `ttl` seconds; returns what
        the joiner needs besides url and token (the source)."""


@runtime_checkable
class PullsFromPeers(Protocol):
    """The engine catches up by pulling a whole version from a peer (peer join's joiner side)."""

    def pull(self, peer: Mapping[str, Any]) -> int:
        """Fetch the current version from `peer` (url, token, source), check every digest and
        commit it; returns the version the engine holds."""


@runtime_checkable
class Scores(Protocol):
    """The engine scores a given sequence: what the probe compares with the trainer's own."""

    def score(self, ids: list[int]) -> tuple[list[float], int]:
        """The logprob of each token of `ids` after the first, and the version that computed them."""


@runtime_checkable
class Distrusts(Protocol):
    """The engine can be told that the probe failed on a version it holds."""

    def distrust(self, version: int, reason: str) -> bool:
        """Serve no gated request until a later version is committed; False: not recorded."""


def group_ranks(adapter: object) -> int:
    """The ranks an engine contributes to a group or a fetch (1 without `JoinsGroups`)."""
    return adapter.group_size() if isinstance(adapter, JoinsGroups) else 1
