"""Peer join inside a push: an engine that lacks the encoding's base (it restarted, or missed a
push) pulls the version this push just committed from a member that holds it, instead of taking
one more whole copy from the trainer.

Only where the transport relays (`Transport.relay_plan` is not None): the user chose a shape so
that the trainer's link carries about one copy per push, and a whole-tensor round per engine
behind would undo that. With star the trainer sends every engine its own copy anyway. The joiner
checks every tensor against this push's digests (the anchor) and commits only a whole version
(`weightsync.fleets.peer`); a join that fails leaves it to the trainer's whole-tensor round."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from weightsync.errors import WeightSyncError
from weightsync.fleets.peer import new_token
from weightsync.interfaces import Adapter, PullsFromPeers, SharesWeights, Transport
from weightsync.sync.report import SyncReport
from weightsync.sync.rounds import Calls, Clock

log = logging.getLogger("weightsync.sync.pipeline")


def pick_peers(joiners: Sequence[Adapter], peers: Sequence[Adapter],
               plan: dict[str, list[str]]) -> dict[str, Adapter]:
    """Each joiner's peer: fewest joiners assigned first, then members that feed no one in the
    relay plan (their links carry one copy in and none out), then by name."""
    load = {p.engine_name: 0 for p in peers}
    feeds = {n for n, kids in plan.items() if kids}
    out: dict[str, Adapter] = {}
    for j in joiners:
        p = min(peers, key=lambda p: (load[p.engine_name], p.engine_name in feeds, p.engine_name))
        load[p.engine_name] += 1
        out[j.engine_name] = p
    return out


class PeerCatchUp:
    """Catches engines that are behind up from current members (see the module docstring)."""

    def __init__(self, transport: Transport, calls: Calls, clock: Clock, report: SyncReport,
                 verify: bool) -> None:
        self.transport, self.calls, self.clock, self.report = transport, calls, clock, report
        self.verify = verify

    def run(self, behind: list[Adapter], current: list[Adapter],
            anchor: list[list[Any]]) -> list[Adapter]:
        """Returns the engines still behind: the trainer's whole-tensor round is theirs."""
        plan = self.transport.relay_plan(current)
        if plan is None or not behind:
            return behind
        version = self.report.version
        joiners = [a for a in behind if isinstance(a, PullsFromPeers)]
        left = [a for a in behind if a not in joiners]
        self._why(left, "its adapter cannot pull from peers (it is not PullsFromPeers)")
        peers = [a for a in current if isinstance(a, SharesWeights)]
        if not joiners:
            return behind
        if not peers or not anchor:
            self._why(joiners, f"no member that committed version {version} can serve peers"
                      if not peers else "the push has no digests to check a peer join against")
            return behind
        chosen = pick_peers(joiners, peers, plan)
        ttl = max(1.0, self.clock.left())
        body = {"version": version, "buckets": anchor}
        with self.clock.timed("peer_join"):
            _, fails = self.calls.each(
                joiners, lambda a: self._join(a, chosen[a.engine_name], ttl, body))
        for a in joiners:
            o = self.report.engines[a.engine_name]
            peer = chosen[a.engine_name].engine_name
            if a.engine_name in fails:
                self._why([a], f"peer join from {peer} failed: {fails[a.engine_name]}")
                left.append(a)
                continue
            o.version, o.caught_up, o.peer = version, True, peer
            o.status = "verified" if self.verify and a.verification == "digest" else "acknowledged"
            o.seconds = self.clock.since()
            log.info("engine %s caught up to version %d from peer %s", a.engine_name, version, peer)
        return [a for a in behind if a in left]

    def _why(self, adapters: Sequence[Adapter], reason: str) -> None:
        for a in adapters:
            self.report.engines[a.engine_name].peer_error = reason
            log.info("engine %s: no peer join (%s); whole tensors from the trainer",
                     a.engine_name, reason)

    @staticmethod
    def _join(joiner: Adapter, peer: Adapter, ttl: float, anchor: dict[str, Any]) -> int:
        assert isinstance(joiner, PullsFromPeers) and isinstance(peer, SharesWeights)
        token = new_token()
        info = peer.share(token, ttl)
        got = joiner.pull({"url": peer.engine.url, "token": token,
                           "source": str(info.get("source") or "http"), "anchor": anchor})
        if got != anchor["version"]:
            raise WeightSyncError(f"after the pull it holds version {got}, not {anchor['version']}")
        return got


__all__ = ["PeerCatchUp", "pick_peers"]
