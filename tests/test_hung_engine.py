"""No hung engine holds the fleet paused. Three real reference engines; one is frozen with
SIGSTOP at the moment the trainer pauses it, or at the moment it commits. The healthy engines are
each resumed as soon as their own commit returns: the report's per-engine pause windows stay
below the frozen engine's call timeout (before, they lasted until the frozen engine's calls and
the abort or health call after them had timed out), the frozen engine's failed resume is not
counted, and once it is thawed the next push reaches all three, bit for bit."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from weightsync_reference import plugin as reference_plugin
from weightsync import WeightSync
from weightsync_reference.adapter import ReferenceAdapter
from weightsync.hookspecs import hookimpl
from weightsync.plugins import load_components, make_plugin_manager
from weightsync_reference.processes import EngineProcess
from weightsync_reference.processes import start_all
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model

CONTROL_TIMEOUT = 4.0          # the frozen engine's pause/resume/health calls give up after this
STOP: dict[str, tuple[int, str]] = {}      # engine name -> (pid, the call at which it freezes)


class FreezesAt(ReferenceAdapter):
    """The reference adapter, which freezes its engine process (SIGSTOP) just before sending
    the call named in STOP: the engine really hangs, the call really times out."""

    name = "freezes_at"

    def _freeze(self, call: str) -> None:
        hit = STOP.get(self.engine_name)
        if hit is not None and hit[1] == call:
            os.kill(hit[0], signal.SIGSTOP)
            for _ in range(1000):           # a stop is delivered asynchronously: wait for it
                if Path(f"/proc/{hit[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                    return
                time.sleep(0.002)
            raise AssertionError(f"engine {self.engine_name} did not stop")

    def pause(self, mode: str) -> None:
        self._freeze("pause")
        super().pause(mode)

    def commit(self, version: int) -> None:
        self._freeze("commit")
        super().commit(version)


class Plugin:
    @hookimpl
    def register_adapters(self, register: Any) -> None:
        register(FreezesAt)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[EngineProcess], dict]]:
    d = tmp_path_factory.mktemp("hung")
    sd = sample_state_dict()
    model = write_weights_only_model(d / "m", sd)
    engines = [EngineProcess(model, name=n, log=d / f"{n}.log") for n in ("a", "b", "frozen")]
    try:
        start_all(engines)
        yield engines, sd
    finally:
        for e in engines:
            if e.proc is not None and e.proc.poll() is None:
                os.kill(e.proc.pid, signal.SIGCONT)
            e.stop()


def config(engines: list[EngineProcess]) -> dict[str, Any]:
    return {"transport": "http", "engines": [e.spec() for e in engines],
            "adapter": {"kind": "freezes_at",
                        "options": {"timeout": CONTROL_TIMEOUT, "payload_timeout": 2 * CONTROL_TIMEOUT}},
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 16 * 1024}},
            "sync": {"progress": "off", "failure_policy": "continue", "lease": 3.0}}


def settled(e: EngineProcess, timeout: float = 30.0) -> dict:
    """The thawed engine's health once no round or pause of the frozen push is left on it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            h = e.health()
            if h.get("round") is None and not h.get("paused"):
                return h
        except Exception:  # noqa: BLE001 - still waking up
            pass
        time.sleep(0.05)
    raise AssertionError(f"engine {e.name} did not settle within {timeout}s")


@pytest.mark.parametrize("call", ["pause", "commit"])
def test_a_frozen_engine_does_not_hold_the_healthy_ones_paused(fleet: Any, call: str) -> None:
    engines, sd = fleet
    frozen = engines[2]
    assert frozen.proc is not None
    pm = make_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="test-freezes-at")
    pm.register(reference_plugin, name="reference")
    with WeightSync.from_config(config(engines), components=load_components(pm)) as sync:
        v = max(e.health()["version"] for e in engines) + 1
        STOP["frozen"] = (frozen.proc.pid, call)
        try:
            report = sync.push(perturb(sd, v), version=v)
        finally:
            STOP.clear()
            os.kill(frozen.proc.pid, signal.SIGCONT)
        o = report.engines["frozen"]
        assert not o.ok and o.stage == call, report.summary()
        assert o.pause_window == 0.0              # its resume never answered: not counted
        for name in ("a", "b"):
            h = report.engines[name]
            assert h.ok and h.status == "verified" and h.version == v, report.summary()
            # resumed when its own commit returned, not when the frozen engine's calls gave up
            assert 0.0 < h.pause_window < CONTROL_TIMEOUT, (name, h.pause_window)
        assert report.pause_window == max(report.engines[n].pause_window for n in ("a", "b"))
        # thawed, the frozen engine takes the next push with the others
        settled(frozen)
        v2 = max(e.health()["version"] for e in engines) + 1
        state = perturb(sd, v2)
        report = sync.push(state, version=v2)
        assert report.ok and report.verified, report.summary()
        for e in engines:
            got = e.weights()
            assert all(torch.equal(got[n], t) for n, t in state.items())
