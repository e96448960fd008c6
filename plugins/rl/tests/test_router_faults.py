"""Rollouts survive engines that stop and callers that leave, against reference engines in their
own processes: a prompt on a frozen engine (SIGSTOP) moves to the other engine within the
client's `stuck` bound and the frozen one drops it when it wakes; a caller that hangs up on the
router has its generations cancelled on the engines, which are free for the next caller; a
prompt whose member lapses moves as soon as the fleet drops it."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterator

import pytest
import requests

from weightsync.testing.waiting import wait_for
from weightsync_reference.models import build_tiny_model
from weightsync_reference.processes import EngineProcess, start_all
from weightsync_rl.rollout import RolloutClient, RolloutRouter
from weightsync_rl.rollout.remote import RouterClient

KEY = "router-key-0123456789abcdef"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    d = tmp_path_factory.mktemp("faults")
    build_tiny_model(d / "m", "llama", vocab=128)
    engines = start_all([EngineProcess(d / "m", name=n, log=d / f"{n}.log") for n in ("a", "b")])
    yield engines
    for e in engines:
        if e.proc is not None:
            os.kill(e.proc.pid, signal.SIGCONT)
        e.stop()


def busy(e: EngineProcess) -> float:
    return float(requests.get(e.url + "/info", timeout=10).json()["busy_seconds"])


def settles(e: EngineProcess, timeout: float = 30.0) -> float:
    """Wait until `e` stops generating (its busy time holds still for half a second)."""
    def still() -> list[float] | None:
        b0 = busy(e)
        time.sleep(0.5)                     # the interval the busy time is compared over
        b1 = busy(e)
        return [b1] if b1 == b0 else None
    return wait_for(still, timeout, f"engine {e.name} to stop generating")[0]


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - read by the test
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_prompt_on_a_frozen_engine_moves_to_the_live_one(pair: list[EngineProcess]) -> None:
    """Engine a freezes (SIGSTOP) with no request of ours yet: of four prompts, the client sends
    two to a; a answers neither a call nor /health, so after `stuck` (2 s) both are cancelled
    there and served by b. Woken, a drops the cancelled work (its caller hung up) instead of
    generating 400 tokens for no one, and serves again."""
    a, b = pair
    client = RolloutClient([a.spec(), b.spec()], refresh=0.0, stuck=2.0)
    assert a.proc is not None
    a0, b0 = settles(a), settles(b)
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        t, out = in_thread(lambda: client.sample([[1, 2, 3]] * 4, {"max_new_tokens": 400},
                                                 wait=120))
        t.join(110)       # bounded: without the move this waits for a (`wait`, 120 s); b's
                          # 1600 tokens take about 3 s here, up to 20 s under CI's load
        assert not t.is_alive(), "the prompts on the frozen engine never moved"
        assert "error" not in out, out
        samples = out["value"]
        assert len(samples) == 4 and {s.engine for s in samples} == {"b"}, samples
        assert client.moved == 2, client.moved
        assert "answered nothing" in str(client.held()["a"]), client.held()
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    # it dropped both rows at their next token: a sliver of what b spent on the same work
    a1, b1 = settles(a), settles(b)
    assert a1 - a0 < 0.2 * (b1 - b0), (a1 - a0, b1 - b0)
    one = RolloutClient([a.spec()], refresh=0.0).sample([[5, 6]], {"max_new_tokens": 4}, wait=30)
    assert len(one) == 1 and one[0].engine == "a"
    client.close()


def test_a_caller_that_hangs_up_cancels_its_work_on_the_engines(pair: list[EngineProcess]) -> None:
    """A caller asks the router for 8 prompts x n 16 x 4000 tokens and hangs up once both
    engines generate for it: both stop generating for it within moments (not after its
    half-million tokens), and the next caller is served."""
    client = RolloutClient([e.spec() for e in pair], refresh=0.0)
    with RolloutRouter(client, api_key=KEY) as router:
        for e in pair:
            settles(e)
        start = {e.name: busy(e) for e in pair}
        body = json.dumps({"prompts": [[1, 2, 3]] * 8,
                           "sampling": {"n": 16, "max_new_tokens": 4000}}).encode()
        host, port = router.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        wait_for(lambda: all(busy(e) > start[e.name] + 0.5 for e in pair), 60,
                 "both engines to generate for the caller")
        sock.close()
        for e in pair:
            settles(e, timeout=20)          # half a million tokens would take minutes
        rc = RouterClient(router.url, api_key=KEY)
        got = rc.sample([[4, 5]] * 2, {"max_new_tokens": 2}, wait=10)
        assert len(got) == 2


def test_a_prompt_moves_when_its_member_lapses(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two engines members of a registry with a 1 s lease; a is frozen: its lease lapses long
    before the client's `stuck` (60 s here), and the prompts it held move to b as soon as the
    client's view of the fleet drops it."""
    from weightsync.fleets.service import RegistryService
    from weightsync.plugins import load_components
    d = tmp_path_factory.mktemp("lapse")
    build_tiny_model(d / "m", "llama", vocab=128)
    key = "lapse-fleet-key-0123456789"
    service = RegistryService(load_components(), lease=1.0, api_key=key, peer_join=False)
    url = service.start()
    engines = [EngineProcess(d / "m", name=n, log=d / f"{n}.log",
                             extra_args=["--fleet", url, "--fleet-key", key]) for n in ("a", "b")]
    try:
        a, b = start_all(engines)
        wait_for(lambda: len(service.members()) == 2, 30, "both engines to register")
        client = RolloutClient(fleet=service.members, refresh=0.0, stuck=60.0)
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGSTOP)
        t, out = in_thread(lambda: client.sample([[1, 2, 3]] * 4, {"max_new_tokens": 300},
                                                 wait=120))
        t.join(45)                          # bounded: `stuck` alone would take 60 s
        assert not t.is_alive(), "the prompts of the lapsed member never moved"
        assert "error" not in out, out
        assert {s.engine for s in out["value"]} == {"b"} and client.moved == 2
        client.close()
    finally:
        for e in engines:
            if e.proc is not None:
                os.kill(e.proc.pid, signal.SIGCONT)
            e.stop()
        service.close()
