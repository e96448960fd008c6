"""Faults with real processes and real signals: an engine killed mid-transfer, an engine that
stalls past the deadline (SIGSTOP), the trainer killed mid-transfer. Nothing is committed that
was not verified, no engine is left paused, the report names who failed and where, and every
process is cleaned up. Waits are bounded waits on state, never fixed sleeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed: install torch first, then "
                                        "`python -m pip install nixl==1.5.1`")

from weightsync import WeightSync  # noqa: E402
from weightsync.testing import perturb, sample_state_dict, write_weights_only_model  # noqa: E402
from weightsync.testing.waiting import wait_for  # noqa: E402
from weightsync_reference.processes import EngineProcess, start_all  # noqa: E402

from weightsync_nixl.sending import NixlTransport  # noqa: E402


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def engines(logs: Path) -> Iterator[list[EngineProcess]]:
    """Two engines for the module; each test leaves them serving (restarted, resumed)."""
    model = write_weights_only_model(logs / "model", sample_state_dict(scale=8))
    procs = [EngineProcess(model, name=f"engine{i}", log=logs / f"engine{i}.log")
             for i in range(2)]
    try:
        yield start_all(procs)
    finally:
        for p in procs:
            if p.proc is not None and p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)       # a stopped engine hears SIGTERM too
            p.stop()


def config(engines: list[EngineProcess], deadline: float = 60.0, stall: float = 60.0) -> dict[str, Any]:
    return {"transport": {"kind": "nixl", "options": {"device": "cpu", "stall": stall}},
            "engines": [e.spec() for e in engines],
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 64 << 10}},
            "sync": {"progress": "off", "failure_policy": "continue", "deadline": deadline,
                     "lease": 2.0}}


def at_bucket(monkeypatch: pytest.MonkeyPatch, index: int, act: Callable[[], None]) -> None:
    """Run `act` once bucket `index` was announced to the engines (they are reading it)."""
    send = NixlTransport.send

    def hooked(self: NixlTransport, payload: Any, engines: Any) -> Any:
        out = send(self, payload, engines)
        if payload.index == index:
            act()
        return out
    monkeypatch.setattr(NixlTransport, "send", hooked)


def settled(e: EngineProcess, version: int) -> bool:
    h = e.health()
    return h["version"] == version and h["round"] is None and h["paused"] is None


def test_an_engine_killed_mid_transfer_fails_alone_and_catches_up_after_restart(
        engines: list[EngineProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = engines
    v = max(e.health()["version"] for e in engines) + 1
    at_bucket(monkeypatch, 2, b.kill)
    sd = perturb(sample_state_dict(scale=8), v)
    with WeightSync.from_config(config(engines)) as sync:
        report = sync.push(sd, version=v)
        assert report.engines["engine0"].status == "verified" and settled(a, v) and a.holds(sd)
        dead = report.engines["engine1"]
        assert dead.status == "failed" and dead.stage in ("send", "finish", "end", "verify"), \
            report.summary()
        assert "engine1" in report.summary() and dead.error
        monkeypatch.undo()
        b.start()                                           # a fresh process at version 0
        assert b.health()["version"] == 0
        sd = perturb(sd, v + 1)
        report = sync.push(sd, version=v + 1)
        assert report.ok and report.verified, report.summary()
        assert settled(a, v + 1) and settled(b, v + 1) and b.holds(sd)


def test_an_engine_stalled_past_the_deadline_is_dropped_and_recovers_by_itself(
        engines: list[EngineProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = engines
    assert b.proc is not None
    v = max(e.health()["version"] for e in engines) + 1
    sd = perturb(sample_state_dict(scale=8), v)
    with WeightSync.from_config(config(engines)) as sync:  # both warm: agents, links, kernels
        assert sync.push(sd, version=v).ok
    with WeightSync.from_config(config(engines, deadline=10.0, stall=3.0)) as sync:
        at_bucket(monkeypatch, 2, lambda: os.kill(b.proc.pid, signal.SIGSTOP))  # type: ignore[union-attr]
        sd2 = perturb(sd, v + 1)
        started = time.monotonic()
        report = sync.push(sd2, version=v + 1)
        assert time.monotonic() - started < 20          # the deadline (10 s) bounds it
    assert report.engines["engine0"].status == "verified" and settled(a, v + 1) and a.holds(sd2)
    stuck = report.engines["engine1"]
    assert stuck.status == "failed" and "engine1" in report.summary(), report.summary()
    assert "within 3s" in str(stuck.error) or "timed out" in str(stuck.error), stuck.error
    os.kill(b.proc.pid, signal.SIGCONT)
    wait_for(lambda: settled(b, v), 30, "the stalled engine to abort its round and resume at "
                                        "its version (its lease lapses)")
    assert b.holds(sd)


def test_the_trainer_killed_mid_transfer_leaves_every_engine_whole(
        tmp_path: Path, logs: Path, engines: list[EngineProcess]) -> None:
    script = Path(__file__).with_name("trainer_script.py")
    held = {e.name: e.health()["version"] for e in engines}
    weights = {e.name: e.weights() for e in engines}
    with open(tmp_path / "trainer.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(script), json.dumps(config(engines)),
                                 str(max(held.values()) + 1)],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            assert proc.wait(120) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for e in engines:
        wait_for(lambda: settled(e, held[e.name]), 30, f"{e.name} to abort the dead trainer's "
                                                       f"round (lease) and stay at its version")
        assert e.holds(weights[e.name])
    text = "".join((logs / f"engine{i}.log").read_text() for i in range(2))
    assert "lease lapsed" in text
