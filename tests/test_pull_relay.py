"""Fetch relays of the `http` transport, for engines that fetch their payload bodies by reference
(vLLM's weightsync backend): the trainer offers one copy per bucket on its body server, each
member fetches from the member above it, checks every piece against the trainer's digests and
offers it on to the members below while later pieces still arrive. The members here are
processes of their own running exactly the code a vLLM worker runs
(`weightsync.transports.http.member_fetch`, through tests/pull_member.py), over real HTTP on loopback; the
live vLLM test is in plugins/vllm."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from weightsync.errors import TransportError
from weightsync.wire.digests import digest_at
from weightsync.interfaces import Message, Payload
from weightsync.transports.http.fetch import FetchRelays
from weightsync.transports.http.messages import FetchPayload

HERE = Path(__file__).resolve().parent
PIECE = 64 << 10


class Member:
    """What the trainer's half asks of an engine (the `Adapter` members fetch relays use), for a
    member process: its body server's URL, and one fetch at a time over its stdin."""

    def __init__(self, name: str) -> None:
        self.engine_name = name
        self.misbehave: str | None = None        # how it treats the next bucket
        self.proc = subprocess.Popen([sys.executable, str(HERE / "pull_member.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = ""
        self.answers: list[dict[str, Any]] = []

    def ready(self) -> Member:
        self.url = json.loads(self._next(120))["url"]
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")                       # the process ended

    def _next(self, timeout: float) -> str:
        line = self.lines.get(timeout=timeout)
        if not line:
            raise TransportError(f"member {self.engine_name} exited (code {self.proc.wait(10)})")
        return line

    def relay_source(self) -> str:
        return self.url

    def group_size(self) -> int:
        return 1

    def deliver(self, message: Message) -> dict[str, Any]:
        assert isinstance(message, FetchPayload), message
        fetch = message.body["fetch"]
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"fetch": fetch, "misbehave": self.misbehave}) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self._next(60))
        self.answers.append(out)
        if "error" in out:
            raise TransportError(out["error"])
        return {}

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def bucket(index: int, nbytes: int, seed: int) -> Payload:
    body = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return Payload(index=index, last=True, encoding="raw", digest="xxh3:-", specs=[], body=body)


def digest(body: torch.Tensor) -> str:
    return digest_at(b"", body.data_ptr(), body.numel())


@pytest.fixture(scope="module")
def pool() -> Iterator[list[Member]]:
    """Six member processes shared by the tests (a member that died is replaced)."""
    ms = [Member(f"m{i}") for i in range(6)]          # they start together
    try:
        yield [m.ready() for m in ms]
    finally:
        for m in ms:
            m.stop()


@pytest.fixture
def members(pool: list[Member], request: Any) -> list[Member]:
    """The first len(param) members of the pool, each told how to treat the next bucket."""
    for i, m in enumerate(pool):
        if m.proc.poll() is not None:
            pool[i] = Member(m.engine_name).ready()
    for m, how in zip(pool, request.param):
        m.misbehave = how
        m.answers = []
    return pool[:len(request.param)]


def relays(degree: int, stall: float = 30.0) -> FetchRelays:
    return FetchRelays(degree, PIECE, stall, "127.0.0.1", None, timeout=60)


@pytest.mark.parametrize("members,degree", [([None] * 4, 1), ([None] * 6, 2)], indirect=["members"])
def test_members_pass_each_bucket_on_and_the_trainer_sends_one_copy(members: list[Member],
                                                                    degree: int) -> None:
    r = relays(degree)
    try:
        for i in range(3):
            p = bucket(i, 3 * PIECE + 1234 * i, seed=i)
            r.open()
            assert r.push(p, p.body, members, lambda: 60.0) == {}
            for m in members:
                assert m.answers[-1] == {"digest": digest(p.body), "from_parent": p.body.numel(),
                                         "reason": None}, m.engine_name
            assert r.events == []
        assert r.trainer_fetches == 3                     # the root's copy of each bucket only
    finally:
        r.close()


@pytest.mark.parametrize("members", [[None, "tamper", None, None]], indirect=True)
def test_a_relay_that_tampers_feeds_no_one_bad_bytes_and_is_blamed(members: list[Member]) -> None:
    r = relays(1)
    p = bucket(0, 5 * PIECE, seed=7)
    try:
        fails = r.push(p, p.body, members, lambda: 60.0)
    finally:
        r.close()
    assert set(fails) == {"m1"} and "do not match the digests" in str(fails["m1"]), fails
    m2 = members[2].answers[-1]
    assert m2["digest"] == digest(p.body) and m2["reason"].startswith("tampered: relay m1")
    assert members[3].answers[-1] == {"digest": digest(p.body), "from_parent": p.body.numel(),
                                      "reason": None}   # fed on by m2 from the trainer's bytes
    assert any("m2 took bytes from the trainer (tampered: relay m1" in e for e in r.events), r.events
    assert r.trainer_fetches == 2


@pytest.mark.parametrize("members,how", [([None, "stall", None, None], "stalled"),
                                         ([None, "die", None, None], "lost")],
                         indirect=["members"])
def test_a_relay_that_stalls_or_dies_costs_its_subtree_nothing(members: list[Member], how: str) -> None:
    r = relays(1, stall=2.0)
    p = bucket(0, 8 * PIECE, seed=3)
    try:
        fails = r.push(p, p.body, members, lambda: 60.0)
    finally:
        r.close()
    assert set(fails) == (set() if how == "stalled" else {"m1"}), fails
    m2 = members[2].answers[-1]
    assert m2["digest"] == digest(p.body) and m2["reason"].startswith(f"{how}: relay m1"), m2
    assert 0 < m2["from_parent"] < p.body.numel()       # the rest came from the trainer
    assert members[3].answers[-1]["digest"] == digest(p.body)
    assert members[3].answers[-1]["reason"] is None     # m2 kept feeding it
    assert r.trainer_fetches == 2
    if how == "stalled":           # m1 relays nothing more this push (and sits out the next)
        assert "it stalled feeding m2 in bucket 0" in r.strikes.remarks().get("m1", ""), \
            r.strikes.remarks()
        assert r.plan(["m0", "m1", "m2", "m3"]) == {"m0": ["m2"], "m2": ["m3"], "m3": ["m1"],
                                                       "m1": []}
