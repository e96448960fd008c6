"""The trainer's half of the `http` transport's relay shapes (chain, tree): per bucket, plan who
feeds whom, announce the bucket to every member over its own channel, send the bytes to the root
only, ask every member for its own signed outcome (never through the tree), and feed directly
every member that lacks the bucket. One root, not `degree`: the trainer's link, which the shapes
spare, sends one copy. The engine's half is `weightsync.transports.http.member_relay`."""

from __future__ import annotations

import logging
import secrets
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any, Callable, Mapping

import requests

from weightsync.errors import TransportError
from weightsync.net.client import Parts
from weightsync.interfaces import Adapter, Endpoint, Payload, RelaysPayloads
from weightsync.transports.http.messages import ExpectRelay, RelayOutcome
from weightsync.transports.http.pieces import checked, piece_digests
from weightsync.transports.http.member_relay import RELAY_HEADER
from weightsync.transports.http.strikes import Relaying, order
from weightsync.wire.frame import frame

log = logging.getLogger("weightsync.transport.relay")


def relay_target(a: Adapter) -> Endpoint | None:
    """Where a parent member posts `a`'s frames; None: `a` takes payloads from the trainer only."""
    return a.relay_target() if isinstance(a, RelaysPayloads) else None


def _target(a: Adapter) -> Endpoint:
    """A relayed member's endpoint (`send` relays only members that have one)."""
    t = relay_target(a)
    assert t is not None
    return t


class Relays(Relaying):
    """Per round: each member's relay token (its parent posts with it) and answer key."""

    def __init__(self, degree: int, piece_bytes: int, stall: float) -> None:
        super().__init__(degree, piece_bytes, stall, log)
        self.tokens: dict[str, str] = {}
        self.keys: dict[str, str] = {}
        self.pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="ws-relay")

    def open(self) -> None:
        with self.lock:
            self.tokens.clear()
            self.keys.clear()
        super().open()

    def _secret(self, table: dict[str, str], name: str) -> str:
        with self.lock:
            return table.setdefault(name, secrets.token_hex(16))

    def _announce(self, payload: Payload, pieces: list[str], kids: dict[str, list[str]],
                  by: dict[str, Adapter], left: Callable[[], float]) -> dict[str, BaseException]:
        """Tell every member of the tree `kids` what bucket `payload.index` is."""
        names = list(kids)
        parent = {c: p for p, cs in kids.items() for c in cs}
        header = payload.header()
        targets = {n: _target(by[n]) for n in names}

        def one(n: str) -> None:
            by[n].deliver(ExpectRelay({
                "index": payload.index, "header": header, "pieces": pieces,
                "piece_bytes": self.piece_bytes, "name": n, "token": self._secret(self.tokens, n),
                "parent": parent.get(n, "the trainer"),
                "ack_key": self._secret(self.keys, n), "stall": self.stall, "left": left(),
                "children": [{"name": c, "url": targets[c].url, "headers": targets[c].headers,
                              "token": self._secret(self.tokens, c), "verify": by[c].engine.verify}
                             for c in kids[n]]}))
        futures = {n: self.pool.submit(one, n) for n in names}
        fails: dict[str, BaseException] = {}
        for n, f in futures.items():
            try:
                f.result(timeout=max(0.05, left()))
            except BaseException as e:  # noqa: BLE001 - that member is fed directly instead
                fails[n] = e
        return fails

    def push(self, payload: Payload, body: Any, members: list[Adapter],
             post: Callable[[Adapter, Any, float], Any], direct: Callable[[Adapter], None],
             left: Callable[[], float]) -> dict[str, BaseException]:
        """One bucket through the tree; returns members not fed at all and relays that tampered."""
        by = {a.engine_name: a for a in members}
        pieces = piece_digests(body, self.piece_bytes)
        kids = self.plan(list(by))
        refused = self._announce(payload, pieces, kids, by, left)
        if refused:                         # plan again without them (their expects failed)
            kids = self.plan([n for n in kids if n not in refused])
            if kids:
                refused.update(self._announce(payload, pieces, kids, by, left))
                kids = self.plan([n for n in kids if n not in refused])
        names = order(kids, next(iter(kids))) if kids else []
        parent = {c: p for p, cs in kids.items() for c in cs}
        self.strikes.fed([n for n in names if kids[n]])
        stalls: dict[str, str] = {}         # member -> the relay it gave up on
        fails: dict[str, BaseException] = {}
        waits: dict[Future[Any], str] = {
            self.pool.submit(self._answer, by[n], payload.index, left): n for n in names}
        if names:                           # the root's POST: None, or why it could not be sent
            waits[self.pool.submit(self._feed_root, payload, body, by[names[0]], post, left)] = ""
        jobs: dict[str, Future] = {}

        def feed(n: str, reason: str) -> None:
            if n in jobs:
                return
            self._note(f"bucket {payload.index}: {n} fed directly by the trainer ({reason})")
            jobs[n] = self.pool.submit(direct, by[n])
            jobs[n].reason = reason  # type: ignore[attr-defined]

        def unreachable(n: str, why: str) -> None:
            """A member that cannot be reached relays nothing: its whole subtree now."""
            feed(n, why)
            for c in order(kids, n)[1:]:             # every member under n in the tree
                feed(c, f"relay {n} above it cannot be reached")
        for n in by:
            if n in refused:
                feed(n, f"its announcement failed: {type(refused[n]).__name__}: {refused[n]}")
        for w in as_completed(waits, timeout=None):
            n = waits[w]
            try:
                got = w.result()
            except BaseException as e:  # noqa: BLE001 - asked again by the direct send
                unreachable(n, f"no answer: {type(e).__name__}: {e}")
                continue
            if not n:
                if got is not None:
                    unreachable(names[0], f"the trainer's copy could not be sent: {got}")
                continue
            if n in jobs:                   # fed directly already: its relay was dropped
                continue
            status = checked(self.keys.get(n, ""), payload.index, got)
            if status == ("ok", payload.digest):
                continue
            why = got.get("error") if isinstance(got, Mapping) else None
            if status is not None and status[0] == "tampered" and n in parent:
                p = parent[n]
                self._note(f"bucket {payload.index}: {n} refused bytes relayed by {p}")
                self._demote(p, f"{n} refused what it relayed in bucket {payload.index}")
                fails[p] = TransportError(
                    f"as a relay it forwarded bytes of bucket {payload.index} to {n} that do not "
                    f"match the digests the trainer announced ({str(why)[:300]}); it is not "
                    f"trusted with this version")
            if status is None and isinstance(why, str) and why.startswith("stalled:") and n in parent:
                self._note(f"bucket {payload.index}: relay {parent[n]} stalled feeding {n}")
                stalls[n] = parent[n]
            feed(n, str(why or status or "its answer was not signed by it"))
        for n, p in stalls.items():         # a relay fed directly itself was starved, not slow
            if p not in jobs:
                self._demote(p, f"it stalled feeding {n} in bucket {payload.index}")
        for n, f in jobs.items():
            if n in fails:
                continue
            try:
                f.result(timeout=max(0.05, left()))
            except BaseException as e:  # noqa: BLE001 - reported per member
                fails[n] = TransportError(f"bucket {payload.index} did not come through the "
                                          f"relay tree ({f.reason}), and the trainer's own send "  # type: ignore[attr-defined]
                                          f"failed too: {type(e).__name__}: {e}")
        return fails

    def _feed_root(self, payload: Payload, body: Any, root: Adapter,
                   post: Callable[[Adapter, Any, float], Any], left: Callable[[], float]
                   ) -> str | None:
        """The one copy that leaves the trainer; None, or why the root could not be reached (one
        that answered, even with a refusal, tells the trainer itself what it lacks)."""
        try:
            t = _target(root)
            headers = {**t.headers, RELAY_HEADER: self._secret(self.tokens, root.engine_name),
                       "Content-Type": "application/octet-stream"}
            post(root, dict(url=t.url, data=Parts(frame(payload.header(), body)),
                            headers=headers), max(0.05, left()))
            return None
        except requests.ConnectionError as e:
            return f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - the root's answer says what it lacks
            log.info("bucket %d to relay root %s: %s: %s", payload.index, root.engine_name,
                     type(e).__name__, e)
            return None

    def _answer(self, member: Adapter, index: int, left: Callable[[], float]) -> Mapping[str, Any]:
        """The member's own outcome, over its own channel, leaving time for a direct send."""
        wait = max(0.05, left() - self.reserve(left()))
        got = member.deliver(RelayOutcome({"index": index, "wait": wait}, wait=wait + 10))
        return got if isinstance(got, Mapping) else {}

    @staticmethod
    def reserve(left: float) -> float:
        """Seconds of the push's time kept for feeding members directly after the tree."""
        return min(left / 3, 60.0)

    def close(self) -> None:
        self.pool.shutdown(wait=False)
