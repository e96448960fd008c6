"""The trainer's half of the `http` transport's relay shapes (chain, tree): per bucket, plan
who feeds whom, announce the bucket to every member over its own channel, send the bytes to the
root only, and feed every member the tree did not reach (or reached with bytes it refused)
straight from the bucket the trainer still holds. The engine's half is
`weightsync.receiver.relay`; the agreement between them is `weightsync.pieces`.

One root, not `degree` roots: every copy that leaves the trainer costs its link a model's
bytes, and the trainer's link is what the shapes exist to spare (trainer egress ~1 x the model).
Degree 1 is the chain: every member's link carries one copy in and one out, so the push takes
about one copy's time plus a piece per hop. A tree of degree d has log_d(N) hops but its inner
members send d copies each, so it is slower wherever links, not hops, are the limit."""

from __future__ import annotations

import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from ..errors import TransportError
from ..httpclient import Parts
from ..interfaces import Adapter, Payload
from ..pieces import checked, piece_digests
from ..receiver.relay import RELAY_HEADER
from ..wire import frame

log = logging.getLogger("weightsync.transport.relay")


def tree(names: Sequence[str], degree: int) -> dict[str, list[str]]:
    """Children per member: names[0] is the root, member k feeds members k*d+1 .. k*d+d
    (breadth first, so the tree is as shallow as the degree allows)."""
    return {n: [names[c] for c in range(k * degree + 1, min(len(names), k * degree + degree + 1))]
            for k, n in enumerate(names)}


def subtree(kids: dict[str, list[str]], name: str) -> list[str]:
    out, todo = [], [name]
    while todo:
        n = todo.pop(0)
        out.append(n)
        todo += kids.get(n, [])
    return out


class Relays:
    """Per round: each member's relay token (lets its parent post to it, this round only) and
    answer key (signs its outcome; no relay ever sees it)."""

    def __init__(self, degree: int, piece_bytes: int, stall: float) -> None:
        self.degree, self.piece_bytes, self.stall = degree, piece_bytes, stall
        self.tokens: dict[str, str] = {}
        self.keys: dict[str, str] = {}
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="ws-relay")
        self.lock = threading.Lock()
        self.events: list[str] = []          # what went around the tree (fallbacks, blame)

    def open(self) -> None:
        with self.lock:
            self.tokens.clear()
            self.keys.clear()
            self.events = []

    def _secret(self, table: dict[str, str], name: str) -> str:
        with self.lock:
            return table.setdefault(name, secrets.token_hex(16))

    def _note(self, msg: str) -> None:
        log.info("%s", msg)
        with self.lock:
            self.events.append(msg)

    def _announce(self, payload: Payload, pieces: list[str], names: list[str],
                  by: dict[str, Adapter], left: Callable[[], float]) -> dict[str, BaseException]:
        """Tell every member of the tree over `names` what bucket `payload.index` is."""
        kids = tree(names, self.degree)
        header = payload.header()
        targets = {n: by[n].relay_target() for n in names}

        def one(n: str) -> None:
            by[n].expect({
                "index": payload.index, "header": header, "pieces": pieces,
                "piece_bytes": self.piece_bytes, "name": n, "token": self._secret(self.tokens, n),
                "ack_key": self._secret(self.keys, n), "stall": self.stall, "left": left(),
                "children": [{"name": c, "url": targets[c].url, "headers": targets[c].headers,
                              "token": self._secret(self.tokens, c), "subtree": subtree(kids, c),
                              "verify": by[c].engine.verify}
                             for c in kids[n]]})
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
        """One bucket through the tree over `members` (see the module docstring); returns the
        members that could not be fed at all, and relays that forwarded tampered bytes."""
        by = {a.engine_name: a for a in members}
        pieces = piece_digests(body, self.piece_bytes)
        names = list(by)
        refused = self._announce(payload, pieces, names, by, left)
        if refused:                         # plan again without them (their expects failed)
            names = [n for n in names if n not in refused]
            if names:
                refused.update(self._announce(payload, pieces, names, by, left))
                names = [n for n in names if n not in refused]
        kids = tree(names, self.degree)
        answers: dict[str, Any] = {}
        why = "no member took the bucket's announcement"
        if names:
            root = names[0]
            t = by[root].relay_target()
            try:
                headers = {**t.headers, RELAY_HEADER: self._secret(self.tokens, root),
                           "Content-Type": "application/octet-stream"}
                resp = post(by[root], dict(url=t.url, data=Parts(frame(payload.header(), body)),
                                           headers=headers), max(0.05, left()))
                got = resp.json() if resp.content else {}
                answers = dict(got.get("members") or {}) if isinstance(got, dict) else {}
                why = str(got.get("error", f"HTTP {resp.status_code}")) if isinstance(got, dict) \
                    else f"HTTP {resp.status_code}"
            except Exception as e:  # noqa: BLE001 - every member is then fed directly
                why = f"{type(e).__name__}: {e}"
        parent = {c: p for p, cs in kids.items() for c in cs}
        todo: list[str] = []
        blamed: dict[str, str] = {}
        for n in by:
            got = checked(self.keys.get(n, ""), payload.index, answers.get(n)) if n in names else None
            if got == ("ok", payload.digest):
                continue
            todo.append(n)
            if got is not None and got[0] == "tampered":
                p = parent.get(n)
                if p is not None:
                    blamed[p] = n
        fails: dict[str, BaseException] = {}
        for p, child in blamed.items():
            self._note(f"bucket {payload.index}: {child} refused bytes relayed by {p}")
            fails[p] = TransportError(
                f"as a relay it forwarded bytes of bucket {payload.index} to {child} that do not "
                f"match the digests the trainer announced; it is not trusted with this version")
        if not todo:
            return fails
        self._note(f"bucket {payload.index}: fed directly by the trainer: {todo}")
        jobs = {n: self.pool.submit(direct, by[n]) for n in todo if n not in fails}
        for n, f in jobs.items():
            reason = answers.get(n, {}).get("error") if isinstance(answers.get(n), dict) else None
            reason = reason or (f"its announcement failed: {refused[n]}" if n in refused else why)
            try:
                f.result(timeout=max(0.05, left()))
            except BaseException as e:  # noqa: BLE001 - reported per member
                fails[n] = TransportError(f"bucket {payload.index} did not come through the "
                                          f"relay tree ({reason}), and the trainer's own send "
                                          f"failed too: {type(e).__name__}: {e}")
        return fails

    def close(self) -> None:
        self.pool.shutdown(wait=False)
