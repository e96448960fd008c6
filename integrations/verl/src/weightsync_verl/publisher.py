"""The trainer side: rank 0 publishes each round's weights as a versioned, hashed manifest plus
one payload frame per bucket (weightsync's peer format: safetensors layout, never pickle), and
runs the fleet registry the rollout replicas register with. A round is done when every replica
that is live in the registry holds its version; a replica that leaves (deregisters, or its lease
lapses) stops counting, so it never blocks a round."""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from weightsync.fleets.peer import SHARE_HEADER, Shares
from weightsync.fleets.service import RegistryService
from weightsync.net.server import HttpError, Routes, Server, make_server
from weightsync.plugins import load_components

log = logging.getLogger("weightsync.verl")
routes = Routes()


class Store:
    """The published version's tensors (CPU copies, in the rollout dtype), by name, in order."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        self.named = named

    def names(self) -> list[str]:
        return list(self.named)

    def get(self, name: str) -> torch.Tensor:
        return self.named[name]


@dataclass
class RoundResult:
    """What one published round reached: the metric dict verl logs per step comes from it."""

    version: int
    tensors: int
    nbytes: int
    buckets: int
    reached: list[str] = field(default_factory=list)      # replicas that hold `version`
    left: list[str] = field(default_factory=list)         # gone or lapsed while waiting
    missing: list[str] = field(default_factory=list)      # live but not there by the deadline
    failed: dict[str, str] = field(default_factory=dict)  # replicas whose pull failed: why
    publish_s: float = 0.0
    wait_s: float = 0.0

    def metrics(self, prefix: str = "weightsync/") -> dict[str, float]:
        return {f"{prefix}version": float(self.version), f"{prefix}bytes": float(self.nbytes),
                f"{prefix}publish_s": self.publish_s, f"{prefix}wait_s": self.wait_s,
                f"{prefix}replicas_ok": float(len(self.reached)),
                f"{prefix}replicas_left": float(len(self.left)),
                f"{prefix}replicas_missing": float(len(self.missing)),
                f"{prefix}replicas_failed": float(len(self.failed))}


class Publisher:
    """Serves the current version to replicas and keeps the registry they join."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 bucket_bytes: int = 64 * 2**20, lease: float = 10.0,
                 api_key: str | None = None) -> None:
        self.key = api_key or secrets.token_urlsafe(24)
        self.share = secrets.token_urlsafe(24)
        self.shares = Shares(bucket_bytes=bucket_bytes)
        self.lock = threading.Lock()
        self.published = threading.Condition(self.lock)
        self.version = 0
        self.store: Store | None = None
        self.failures: dict[int, dict[str, str]] = {}   # version -> replica -> its error
        self.registry = RegistryService(load_components(), lease=lease, api_key=self.key,
                                        peer_join=False, health_check=False)
        self.registry_url = self.registry.start(host, port)
        self.server: Server = make_server(routes, host, 0, api_key=None, name="verl weights",
                                          state={"publisher": self})
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="ws-verl-weights", daemon=True).start()
        where = advertise or ("127.0.0.1" if host in ("0.0.0.0", "") else host)
        self.url = f"http://{where}:{self.server.server_address[1]}"
        if advertise:
            self.registry_url = f"http://{advertise}:{self.registry_url.rsplit(':', 1)[1]}"

    def metadata(self) -> dict[str, Any]:
        """What every replica needs (it travels through verl's own topology exchange)."""
        return {"url": self.url, "token": self.share, "registry": self.registry_url,
                "key": self.key}

    def publish(self, named: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Make `named` version `version` (default: the next one); hashed once here, then
        served to every replica."""
        with self.lock:
            version = self.version + 1 if version is None else int(version)
            if version <= self.version:
                raise ValueError(f"version {version} is not newer than the published version "
                                 f"{self.version}; versions must grow with every round")
            self.store = Store(named)
            self.shares.manifest(version, self.store)
            self.version = version
            self.published.notify_all()
        return version

    def _check(self, token: str | None) -> None:
        """Every replica pulls every round with the round's share token (weightsync's own peer
        shares are one pull each; these are the actor's, served to its own replicas)."""
        if not token or not hmac.compare_digest(token.encode(), self.share.encode()):
            raise HttpError(401, "missing or wrong share token: take it from the actor's topology")

    def await_version(self, token: str | None, after: int, timeout: float) -> dict[str, Any]:
        """Long poll: returns once a version newer than `after` is published (or at
        `timeout`), with the version served now."""
        self._check(token)
        with self.published:
            self.published.wait_for(lambda: self.version > after, timeout=max(0.0, timeout))
            return {"version": self.version}

    def manifest(self, token: str | None) -> dict[str, Any]:
        self._check(token)
        with self.lock:
            if self.store is None:
                raise HttpError(409, "nothing is published yet: the trainer has not sent a round")
            return self.shares.manifest(self.version, self.store)

    def bucket(self, token: str | None, index: int, version: int) -> bytes:
        self._check(token)
        with self.lock:
            if self.store is None or version != self.version:
                raise HttpError(409, f"version {version} is no longer served (now "
                                     f"{self.version}): fetch the manifest again")
            parts = self.shares.bucket(version, index, self.store)
        return b"".join(bytes(p) for p in parts)

    def report_failure(self, token: str | None, name: str, version: int, error: str) -> None:
        """A replica's pull of `version` failed (it says why): the round stops waiting for it
        and names it, instead of waiting out its deadline."""
        self._check(token)
        roster = self.registry.roster
        with roster.changed:
            self.failures.setdefault(int(version), {})[name[:128]] = error[:2000]
            roster.changed.notify_all()
        log.warning("replica %s failed to take version %d: %s", name, version, error)

    def replicas(self) -> dict[str, dict[str, Any]]:
        """The registry's members (replicas), by name: state, version, lease left."""
        self.registry.roster.expire()
        return {m["name"]: m for m in self.registry.roster.view()["members"]}

    def wait(self, version: int, timeout: float, expected: int | None = None) -> tuple[list[str], list[str], list[str]]:
        """Until every live replica holds `version` (or `timeout`); a replica that deregisters
        or lapses meanwhile is dropped, one that reported a failed pull is not waited for.
        `expected`: wait (within `timeout`) for at least this many replicas to register first.
        Returns (reached, left, missing); `failures[version]` holds who failed and why."""
        deadline = time.monotonic() + timeout
        seen: set[str] = set()
        roster = self.registry.roster
        with roster.changed:
            while True:
                now = {n: m for n, m in self.replicas().items()}
                live = {n for n, m in now.items() if m["state"] != "lapsed"}
                seen |= live
                failed = set(self.failures.get(version, {}))
                behind = {n for n in live if (now[n]["version"] or 0) < version}
                enough = expected is None or len(live) >= expected
                if (not behind - failed and enough) or time.monotonic() >= deadline:
                    reached = sorted(n for n in live if n not in behind)
                    return reached, sorted(seen - live), sorted(behind - failed)
                roster.changed.wait(min(0.25, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.registry.close()


@routes.add("GET", "/weightsync/peer/manifest", auth=False, max_body=0)
def _manifest(h: Any, q: dict) -> Any:
    return h.publisher.manifest(h.headers.get(SHARE_HEADER))


@routes.add("GET", "/weightsync/verl/version", auth=False, max_body=0)
def _version(h: Any, q: dict) -> Any:
    try:
        after, timeout = int(q["after"][0]), min(float(q.get("timeout", ["30"])[0]), 300.0)
    except (KeyError, ValueError, IndexError):
        raise HttpError(400, "verl/version needs ?after=v[&timeout=s]") from None
    return h.publisher.await_version(h.headers.get(SHARE_HEADER), after, timeout)


@routes.add("POST", "/weightsync/verl/failed", auth=False, max_body=64 * 1024)
def _failed(h: Any, q: dict) -> Any:
    body = h.json_body()
    try:
        name, version, error = str(body["name"]), int(body["version"]), str(body["error"])
    except (KeyError, TypeError, ValueError):
        raise HttpError(400, 'verl/failed needs {"name", "version", "error"}') from None
    h.publisher.report_failure(h.headers.get(SHARE_HEADER), name, version, error)
    return {"ok": True}


@routes.add("GET", "/weightsync/peer/bucket", auth=False, max_body=0)
def _bucket(h: Any, q: dict) -> Any:
    try:
        index, version = int(q["index"][0]), int(q["version"][0])
    except (KeyError, ValueError, IndexError):
        raise HttpError(400, "peer/bucket needs ?index=i&version=v") from None
    return h.publisher.bucket(h.headers.get(SHARE_HEADER), index, version)
