"""The trainer's half of the `http` transport's fetch relays: the chain and tree shapes for engines
that fetch payload bodies by reference (`RelaysFetches`: vLLM's backend). Per bucket the trainer
plans the tree, publishes the body once for the root, and tells every member (`FetchPayload`)
where to fetch it (its parent's body server), the digest of every piece, and a fallback to the
trainer's copy that only it holds: a member whose parent dies, stalls or sends a bad piece takes
the rest from the trainer and says why; a parent that sent bad bytes fails the push for itself.
The member's half is `weightsync.transports.http.member_fetch`."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from weightsync.net.bodyserver import REASON_HEADER, BodyServer
from weightsync.errors import TransportError
from weightsync.interfaces import Adapter, Payload, RelaysFetches
from weightsync.interfaces.capabilities import group_ranks
from weightsync.transports.http.messages import FetchPayload
from weightsync.transports.http.pieces import piece_digests
from weightsync.transports.http.strikes import Relaying, order

log = logging.getLogger("weightsync.transport.pull")


def depths(kids: dict[str, list[str]], root: str) -> dict[str, int]:
    out = {root: 0}
    for n in order(kids, root):
        out.update((c, out[n] + 1) for c in kids.get(n, []))
    return out


class FetchRelays(Relaying):
    """The fetch relays of one transport: its body server and the plan per bucket."""

    def __init__(self, degree: int, piece_bytes: int, stall: float, host: str,
                 advertise: str | None, timeout: float) -> None:
        super().__init__(degree, piece_bytes, stall, log)
        self.bodies = BodyServer(host, advertise=advertise, timeout=timeout, max_connections=64)
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="ws-pull")
        self.trainer_fetches = 0             # bodies fetched from the trainer (root + fallbacks)

    def push(self, payload: Payload, body: Any, members: Sequence[Adapter],
             left: Callable[[], float]) -> dict[str, BaseException]:
        """One bucket through the tree over `members`; returns the members that failed."""
        fails: dict[str, BaseException] = {}
        sources: dict[str, str] = {}
        for a in members:                # where each member offers what it fetched
            try:
                offered = a.relay_source() if isinstance(a, RelaysFetches) else None
            except Exception as e:  # noqa: BLE001 - that member's own fetch reports it
                log.info("engine %s: no relay source: %s", a.engine_name, e)
                offered = None
            if offered is not None:
                sources[a.engine_name] = offered
        by = {a.engine_name: a for a in members}
        names = [n for n in by if n in sources]
        kids = self.plan(names)
        names = list(kids)                   # the root first
        self.strikes.fed([n for n in names if kids[n]])
        parent = {c: p for p, cs in kids.items() for c in cs}
        depth = depths(kids, names[0]) if names else {}
        pieces = piece_digests(body, self.piece_bytes)
        view = memoryview(body.numpy()) if body.numel() else memoryview(b"")
        refs: list[dict[str, Any]] = []
        bad: dict[str, str] = {}
        stalled: dict[str, str] = {}         # member -> the relay it gave up on
        fell: set[str] = set()               # members that took bytes from the trainer

        def fallback_of(n: str) -> Callable[[Mapping[str, str]], None]:
            def seen(headers: Mapping[str, str]) -> None:
                why = str(headers.get(REASON_HEADER, "") or "no reason given")
                with self.lock:
                    self.trainer_fetches += 1
                self._note(f"bucket {payload.index}: {n} took bytes from the trainer ({why})")
                fell.add(n)
                if why.startswith("tampered:") and n in parent:
                    bad[parent[n]] = n
                if why.startswith("stalled:") and n in parent:
                    stalled[n] = parent[n]
            return seen

        def counted(_: Mapping[str, str]) -> None:
            with self.lock:
                self.trainer_fetches += 1

        serve = {n: {"id": secrets.token_hex(8), "token": secrets.token_urlsafe(16),
                     "fetches": sum(group_ranks(by[c]) for c in kids[n])}
                 for n in names if kids[n]}
        specs: dict[str, dict[str, Any]] = {}
        for n in names:
            if n == names[0]:
                src = self.bodies.publish(view, fetches=group_ranks(by[n]), on_fetch=counted)
                refs.append(src)
                fallback = None
            else:
                p = serve[parent[n]]
                src = {"url": f"{sources[parent[n]]}?id={p['id']}", "token": p["token"],
                       "nbytes": len(view)}
                fallback = self.bodies.publish(view, fetches=group_ranks(by[n]),
                                               on_fetch=fallback_of(n))
                refs.append(fallback)
            # deeper members wait longer, so the one under a stalled relay recovers (from the
            # trainer) before those below it give up too
            specs[n] = {**src, "relay": {
                "pieces": pieces, "piece_bytes": self.piece_bytes, "parent": parent.get(n, "the trainer"),
                "stall": self.stall * (1 + 0.5 * depth[n]), "serve": serve.get(n),
                "fallback": fallback}}
        header = payload.header()
        futures = {n: self.pool.submit(by[n].deliver, FetchPayload({"header": header, "fetch": specs[n]})) for n in names}
        for n, a in by.items():
            if n not in sources:             # no source: it takes its own copy from the trainer
                ref = self.bodies.publish(view, fetches=group_ranks(a), on_fetch=counted)
                refs.append(ref)
                futures[n] = self.pool.submit(a.deliver, FetchPayload({"header": header, "fetch": ref}))
        try:
            for n, f in futures.items():
                try:
                    f.result(timeout=max(0.05, left()))
                except BaseException as e:  # noqa: BLE001 - reported per member
                    fails[n] = e
        finally:
            for ref in refs:
                self.bodies.withdraw(ref)
        for child, relay in stalled.items():   # a relay that itself fell back was starved
            if relay not in fell:
                self._demote(relay, f"it stalled feeding {child} in bucket {payload.index}")
        for relay, child in bad.items():
            self._demote(relay, f"{child} refused what it passed on in bucket {payload.index}")
            fails.setdefault(relay, TransportError(
                f"as a relay it passed bytes of bucket {payload.index} to {child} that do not "
                f"match the digests the trainer announced; it is not trusted with this version"))
        return fails

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.bodies.close()
