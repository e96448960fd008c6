"""How this engine serves a joiner its current version: over its own HTTP routes (peer source
`http`, built in), or through another peer source's serving half (`PeerSource.hosting`, e.g.
registered memory a joiner READs one-sided). The engine calls these under its model lock, so what
a share serves is always the version the engine holds: the hosting publishes that version when a
share asks for it, and is withdrawn whenever the engine's weights change."""

from __future__ import annotations

import logging
from typing import Any

from weightsync.fleets.peer import Shares
from weightsync.interfaces import PeerHosting

log = logging.getLogger("weightsync_reference.server")


class Sharing:
    def __init__(self, components: Any, source: str = "http", hmac_key: bytes | None = None) -> None:
        self.source = source
        self.shares = Shares(key=hmac_key)          # the http routes' tokens and manifest
        self.hosting: PeerHosting | None = None
        if source != "http":
            self.hosting = components.peer_sources.get(source)().hosting()

    def share(self, token: str, ttl: float, version: int, store: Any) -> dict[str, Any]:
        """Open a share of `version` (the weights in `store`) for one pull by `token`."""
        if self.hosting is None:
            self.shares.open(token, ttl, version)
            return {"version": version, "source": "http"}
        if self.hosting.version != version:
            self.hosting.publish(version, {n: store.get(n) for n in store.names()})
            log.info("peer source %s serves version %d", self.source, version)
        return self.hosting.share(token, ttl)

    def manifest(self, token: str | None, version: int, store: Any) -> dict[str, Any]:
        if self.hosting is not None:
            return self.hosting.manifest(token)
        self.shares.check(token, version)
        return self.shares.manifest(version, store)

    def bucket(self, token: str | None, index: int, version: int, store: Any) -> list[Any]:
        """One payload frame over the http routes (a hosting's joiners read it elsewhere)."""
        self.shares.check(token, version, index)
        out = self.shares.bucket(version, index, store)
        self.shares.served_all(token, len(self.shares.manifest(version, store)["buckets"]))
        return out

    def moved(self) -> None:
        """The engine's weights changed: what the hosting serves is no longer held."""
        if self.hosting is not None and self.hosting.version is not None:
            self.hosting.withdraw()

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "served_buckets": self.shares.served}
        if self.hosting is not None:
            out["hosting"] = self.hosting.health()
        return out

    def close(self) -> None:
        if self.hosting is not None:
            self.hosting.close()
