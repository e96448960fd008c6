"""The rollout side: a replica registers itself with the trainer's fleet registry (heartbeating
the version it holds), and each round pulls the published version: the manifest (checked against
its schema), then one frame per bucket whose tensors are yielded only after their digest matched
the manifest's. A replica that joins late simply pulls the current version: it catches up in one
round, whatever it missed."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import torch
from weightsync.wire.bucket import digest_algo, digest_tensors
from weightsync.errors import PayloadError
from weightsync.fleets.member import Membership
from weightsync.fleets.peer import MAX_MANIFEST, SHARE_HEADER, HttpPeerSource, parse_manifest
from weightsync.wire.frame import unpack

log = logging.getLogger("weightsync.verl")


def replica_name(rank: int) -> str:
    """A name unique per process on this host: host, pid and the rank verl gave it."""
    host = socket.gethostname().split(".")[0] or "host"
    return f"{host}-{os.getpid()}-r{rank}"


class Subscriber:
    """One rollout worker's membership and pulls."""

    def __init__(self, master: dict[str, Any], name: str) -> None:
        for k in ("url", "token", "registry", "key"):
            if not master.get(k):
                raise ValueError(f"the trainer's checkpoint-engine metadata has no {k!r}: is the "
                                 f"trainer also using the weightsync backend?")
        self.master = dict(master)
        self.name = name
        self.version = 0
        self.source = HttpPeerSource()
        # `url` is informational for a replica (the registry never calls it): role host
        self.membership = Membership(master["registry"], master["key"],
                                     {"name": name, "url": master["url"], "role": "host",
                                      "adapter": {"kind": "reference"}},
                                     version=lambda: self.version)
        self.membership.start()
        self._left = False
        atexit.register(self.leave)          # a clean exit deregisters: no round waits for it

    def wait_for(self, after: int, timeout: float) -> int:
        """Until the trainer publishes a version newer than `after` (long poll, bounded by
        `timeout`); returns the version published now."""
        deadline = time.monotonic() + timeout
        url = self.master["url"].rstrip("/") + "/weightsync/verl/version"
        while True:
            left = deadline - time.monotonic()
            r = self.source.session.get(url, params={"after": after, "timeout": min(30.0, max(left, 0))},
                                        headers={SHARE_HEADER: self.master["token"]},
                                        timeout=min(30.0, max(left, 0)) + 30)
            if r.status_code != 200:
                raise PayloadError(f"the trainer at {self.master['url']} answered HTTP "
                                   f"{r.status_code} to verl/version: {r.text[:300]}")
            v = int(r.json()["version"])
            if v > after or time.monotonic() >= deadline:
                return v

    def pull(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The published version, bucket by bucket, each verified before it is yielded; then
        the new version is reported to the registry at once (the trainer waits on it). Yields
        nothing when the trainer has nothing newer than what this replica holds. A failure is
        reported to the trainer (so its round does not wait for this replica) and raised."""
        peer = {"url": self.master["url"], "token": self.master["token"]}
        man = parse_manifest(self.source.manifest(peer))
        if man.version <= self.version:
            return
        try:
            yield from self._buckets(peer, man)
        except Exception as e:
            self._report(man.version, f"{type(e).__name__}: {e}")
            raise
        self.version = man.version
        try:
            self.membership.client.heartbeat(self.name, self.version, self.membership.credential)
        except Exception as e:  # noqa: BLE001 - the periodic heartbeat carries it anyway
            log.warning("reporting version %d to the registry failed: %s", self.version, e)

    def _report(self, version: int, error: str) -> None:
        try:
            self.source.session.post(self.master["url"].rstrip("/") + "/weightsync/verl/failed",
                                     json={"name": self.name, "version": version, "error": error},
                                     headers={SHARE_HEADER: self.master["token"]}, timeout=10)
        except Exception as e:  # noqa: BLE001 - the round then waits until its deadline
            log.warning("telling the trainer that version %d failed here failed too: %s", version, e)

    def _buckets(self, peer: dict[str, Any], man: Any) -> Iterator[tuple[str, torch.Tensor]]:
        peer.update(version=man.version, max_bucket_bytes=max(b.nbytes for b in man.buckets)
                    + MAX_MANIFEST)
        for b in man.buckets:
            header, body = self.source.bucket(peer, b.index)
            if int(header.get("version", -1)) != man.version:
                raise PayloadError(f"the trainer moved on from version {man.version} during the "
                                   f"pull; pull again")
            names = [t.name for t in b.tensors]
            if header.get("index") != b.index or header.get("digest") != b.digest \
                    or [t.get("name") for t in header.get("tensors", [])] != names:
                raise PayloadError(f"bucket {b.index} does not match the manifest")
            by_name = dict(unpack(body)[0])
            if sorted(by_name) != sorted(names):
                raise PayloadError(f"bucket {b.index} holds {sorted(by_name)[:3]}..., the "
                                   f"manifest says {sorted(names)[:3]}...")
            named = [(n, by_name[n]) for n in names]        # the manifest's order
            got = digest_tensors(named, algo=digest_algo(b.digest))
            if got != b.digest:
                raise PayloadError(f"bucket {b.index} of version {man.version}: digest {got} is "
                                   f"not the manifest's {b.digest}; nothing of it was yielded")
            yield from named

    def leave(self) -> None:
        """Deregister: the trainer stops waiting for this replica at once (idempotent)."""
        if not self._left:
            self._left = True
            self.membership.stop()
