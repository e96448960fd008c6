"""Catch-up by peer join, driven by the registry: a member behind the fleet's version pulls it from
the current member serving fewest joiners, through a one-time share, checked against the trainer's
digests for the version; pushes skip it meanwhile. A lying peer is named and the next one tried;
with no peer able to serve it, it is marked `behind` and the next push sends it whole tensors."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from weightsync.fleets.peer import new_token
from weightsync.interfaces.capabilities import PullsFromPeers, SharesWeights

log = logging.getLogger("weightsync.fleets")


class CatchUp:
    def __init__(self, service: Any, *, enabled: bool = True, ttl: float = 600.0,
                 attempts: int = 3, cooldown: float = 60.0) -> None:
        self.service, self.enabled, self.ttl, self.attempts = service, enabled, ttl, attempts
        self.cooldown = cooldown
        self.failed: dict[str, tuple[int, float]] = {}   # member -> (version, when) of a failed try
        self.wake = threading.Event()
        self.stop_ = threading.Event()
        self.jobs: dict[str, threading.Thread] = {}
        self.thread = threading.Thread(target=self._run, name="ws-catchup", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_.set()
        self.wake.set()

    def poke(self) -> None:
        self.wake.set()

    def _run(self) -> None:
        while not self.stop_.is_set():
            self.wake.wait(0.5)
            self.wake.clear()
            try:
                self._scan()
            except Exception as e:  # noqa: BLE001 - the loop must outlive any one member
                log.warning("catch-up scan failed: %s", e)

    def _lags(self, m: Any, current: int, now: float) -> bool:
        """Behind the fleet, no join running for it, and no failed one for this version lately."""
        return (m.reg.role == "engine" and m.state in ("live", "behind")
                and (m.version or 0) < current and m.reg.name not in self.jobs
                and not (self.failed.get(m.reg.name, (-1, 0.0))[0] == current
                         and now - self.failed[m.reg.name][1] < self.cooldown))

    def due(self, m: Any) -> bool:
        """A live member the next scan starts a peer join for (roster lock held): pushes skip it."""
        current = self.service.roster.current
        if not self.enabled or current is None or m.state != "live" \
                or not self._lags(m, current, time.monotonic()):
            return False
        cls = self.service.components.adapters.get(m.reg.adapter.kind)
        return issubclass(cls, PullsFromPeers) and bool(self._peers(m.reg.name, current, set()))

    def _scan(self) -> None:
        roster = self.service.roster
        roster.expire()
        with roster.lock:
            current = roster.current
            if current is None:
                return
            now = time.monotonic()
            behind = [m for m in roster.members.values() if self._lags(m, current, now)]
        for m in behind:
            cls = self.service.components.adapters.get(m.reg.adapter.kind)
            if not self.enabled or not issubclass(cls, PullsFromPeers):
                roster.set_state(m.reg.name, "behind", "behind the fleet; the next push catches it up")
                continue
            roster.set_state(m.reg.name, "joining")
            t = threading.Thread(target=self._join, args=(m.reg.name, current), daemon=True,
                                 name=f"ws-join-{m.reg.name}")
            self.jobs[m.reg.name] = t
            t.start()

    def _peers(self, joiner: str, version: int, tried: set[str]) -> list[Any]:
        roster = self.service.roster
        adapters = self.service.components.adapters
        with roster.lock:
            peers = [m for m in roster.members.values()
                     if m.reg.name != joiner and m.reg.name not in tried and m.reg.role == "engine"
                     and m.state == "live" and m.version == version
                     and issubclass(adapters.get(m.reg.adapter.kind), SharesWeights)]
            return sorted(peers, key=lambda m: (m.serving, m.reg.name))

    def _join(self, name: str, version: int) -> None:
        roster = self.service.roster
        tried: set[str] = set()
        errors = []
        try:
            anchor = self.service.anchors.get(version)
            if anchor is None:
                errors.append(f"the registry has no digests from the trainer for version "
                              f"{version} (it restarted since that push); a peer join could "
                              f"not be checked")
            for _ in range(self.attempts if anchor is not None else 0):
                with roster.lock:
                    joiner = roster.members.get(name)
                    peers = self._peers(name, version, tried)
                    if joiner is None or not peers:
                        break
                    peer = peers[0]
                    peer.serving += 1
                    joiner.via = peer.reg.name
                tried.add(peer.reg.name)
                try:
                    token = new_token()
                    source, puller = self.service.adapter(peer), self.service.adapter(joiner)
                    assert isinstance(source, SharesWeights) and isinstance(puller, PullsFromPeers)
                    info = source.share(token, self.ttl)
                    got = puller.pull(
                        {"url": peer.reg.url, "token": token, "source": info.get("source", "http"),
                         "anchor": {"version": version, "buckets": anchor}})
                    with roster.lock:
                        joiner.version = got
                        joiner.pulled += 1
                        joiner.state, joiner.error = "live", None
                    log.info("member %s caught up to version %s from peer %s", name, got, peer.reg.name)
                    return
                except Exception as e:  # noqa: BLE001 - another peer, or the trainer, next
                    errors.append(f"{peer.reg.name}: {e}")
                    log.warning("member %s could not catch up from peer %s: %s", name, peer.reg.name, e)
                finally:
                    with roster.lock:
                        peer.serving -= 1
            self.failed[name] = (version, time.monotonic())      # no retry of this version soon
            roster.set_state(name, "behind", "; ".join(errors) or "no current peer can serve it; "
                                                                  "the next push catches it up")
        finally:
            self.jobs.pop(name, None)
