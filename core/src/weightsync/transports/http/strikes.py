"""Which members may relay (the `http` transport's chain and tree shapes, push or fetch). A member
that stalled feeding a child, or whose child refused what it forwarded, is planned as a leaf for
the rest of the push and sits out relaying the next pushes: one after its first strike, twice as
many after each further one (at most `MAX_BENCH`); a clean relaying push clears its record.
Benched members hang under the relays as leaves, deepest first."""

from __future__ import annotations

import logging
import threading
from typing import Collection, Sequence

__all__ = ["MAX_BENCH", "Relaying", "Strikes", "plan", "tree"]

MAX_BENCH = 16        # pushes a member sits out at most, however often it misbehaved


def tree(names: Sequence[str], degree: int) -> dict[str, list[str]]:
    """Children per member, breadth first: names[0] is the root, member k feeds k*d+1 .. k*d+d."""
    return {n: [names[c] for c in range(k * degree + 1, min(len(names), k * degree + degree + 1))]
            for k, n in enumerate(names)}


def plan(names: Sequence[str], degree: int, leaves: Collection[str] = ()) -> dict[str, list[str]]:
    """The tree over `names`, those in `leaves` hung under a relay (unless every one is)."""
    out = set(leaves)
    relays = [n for n in names if n not in out]
    benched = [n for n in names if n in out]
    if not relays:
        return tree(benched, degree)
    kids = tree(relays, degree)
    hosts = relays[::-1]                 # deepest first: the leaves of the relays' tree
    for k, n in enumerate(benched):
        kids[hosts[k % len(hosts)]].append(n)
        kids[n] = []
    return kids


def order(kids: dict[str, list[str]], root: str) -> list[str]:
    """The members of `kids` breadth first from `root` (the root first: the trainer feeds it)."""
    out, todo = [], [root]
    while todo:
        n = todo.pop(0)
        out.append(n)
        todo += kids.get(n, [])
    return out


class Strikes:
    """Members planned as leaves: this push's (`demote`) and those benched from earlier ones."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count: dict[str, int] = {}        # strikes so far (cleared by a clean push)
        self.bench: dict[str, int] = {}        # later pushes still to sit out
        self.reason: dict[str, str] = {}       # what its last strike was
        self.now: set[str] = set()             # leaves this push
        self.struck: set[str] = set()          # demoted during this push
        self.relayed: set[str] = set()         # members that fed a child this push

    def open(self) -> None:
        """A new push: the benched sit it out; a clean relay of the last push starts clean."""
        with self.lock:
            for n in self.relayed - self.struck - set(self.bench):
                self.count.pop(n, None)
                self.reason.pop(n, None)
            self.now = set(self.bench)
            self.bench = {n: k - 1 for n, k in self.bench.items() if k > 1}
            self.struck, self.relayed = set(), set()

    def leaves(self) -> set[str]:
        with self.lock:
            return set(self.now)

    def fed(self, names: Sequence[str]) -> None:
        """`names` fed children in this push's plan."""
        with self.lock:
            self.relayed.update(names)

    def demote(self, name: str, why: str) -> bool:
        """`name` misbehaved as a relay: a leaf now, benched later; False if a leaf already."""
        with self.lock:
            if name in self.now:
                return False
            self.now.add(name)
            self.struck.add(name)
            self.count[name] = k = self.count.get(name, 0) + 1
            self.bench[name] = min(2 ** (k - 1), MAX_BENCH)
            self.reason[name] = why
            return True

    def remarks(self) -> dict[str, str]:
        """This push's leaves, and why."""
        with self.lock:
            out = {}
            for n in self.now:
                k, why = self.count.get(n, 0), self.reason.get(n, "misbehaved as a relay")
                if n in self.struck:
                    sit = self.bench.get(n, 0)
                    out[n] = (f"relay demoted: {why}; a leaf for the rest of this push and "
                              f"the next {sit} push{'es' if sit != 1 else ''}")
                else:
                    out[n] = f"relay benched (strike {k}: {why}); a leaf this push"
            return out


class Relaying:
    """What both relay shapes keep across pushes: degree, strikes, and `events` (also logged)."""

    def __init__(self, degree: int, piece_bytes: int, stall: float, log: logging.Logger) -> None:
        self.degree, self.piece_bytes, self.stall, self.log = degree, piece_bytes, stall, log
        self.lock = threading.Lock()
        self.events: list[str] = []
        self.strikes = Strikes()

    def open(self) -> None:
        with self.lock:
            self.events = []
        self.strikes.open()

    def plan(self, names: Sequence[str]) -> dict[str, list[str]]:
        """Who feeds whom among `names` this bucket: relays that misbehaved are leaves."""
        return plan(names, self.degree, self.strikes.leaves())

    def _note(self, msg: str) -> None:
        self.log.info("%s", msg)
        with self.lock:
            self.events.append(msg)

    def _demote(self, name: str, why: str) -> None:
        if self.strikes.demote(name, why):
            self._note(f"relay {name} demoted to a leaf: {why}")
