"""A name belongs to its credential across registry restarts and lapses (issue 39), with real
processes: a registry (`weightsync fleet serve`, killed with SIGKILL and started again on the
same port and state file), a real engine registered under the name `victim`, and a rogue that
holds only the fleet key. The rogue never gets the name: not while the registry restarts, not
while the victim is frozen past its lease; the victim comes back on its own, and a push reports
it verified only because the engine that holds the name took the weights. A member's claim of a
version never sets the trainer's labels."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
from weightsync import WeightSync
from weightsync.fleets.client import RegistryClient, RegistryError
from weightsync.net.process import ServerProcess
from weightsync.net.server import free_port
from weightsync.sync.report import held_by_most
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model
from weightsync.testing.waiting import fleet_member as member
from weightsync.testing.waiting import wait_for
from weightsync_reference.processes import EngineProcess

KEY = "names-fleet-key-0123456789"
TRAINER = "names-trainer-key-0123456789"
LEASE = 1.0


class Registry:
    """`weightsync fleet serve` in its own process, restartable on the same port and state."""

    def __init__(self, tmp: Path) -> None:
        self.port, self.tmp = free_port(), tmp
        (tmp / "fleet.key").write_text(KEY)
        (tmp / "trainer.key").write_text(TRAINER)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = ServerProcess("registry", tmp / "registry.log")

    def start(self) -> "Registry":
        self.proc.launch([sys.executable, "-m", "weightsync", "fleet", "serve", "--port",
                          str(self.port), "--api-key-file", str(self.tmp / "fleet.key"),
                          "--trainer-key-file", str(self.tmp / "trainer.key"), "--state-file",
                          str(self.tmp / "fleet.json"), "--lease", str(LEASE)])
        self.proc.wait_healthy(self.url + "/health", timeout=60)
        return self

    def view(self) -> dict[str, Any]:
        return RegistryClient(self.url, KEY).fleet()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Registry, EngineProcess, dict]]:
    sd = sample_state_dict()
    model = write_weights_only_model(tmp_path / "m", sd)
    reg = Registry(tmp_path).start()
    victim = EngineProcess(model, name="victim", log=tmp_path / "victim.log",
                           extra_args=["--fleet", reg.url, "--fleet-key", KEY])
    try:
        victim.start()
        wait_for(lambda: (member(reg.view(), "victim") or {}).get("state") == "live",
                 what="victim registered")
        yield reg, victim, sd
    finally:
        if victim.proc is not None and victim.proc.poll() is None:
            os.kill(victim.proc.pid, signal.SIGCONT)
        victim.stop()
        reg.proc.stop()


def _push(reg: Registry, sd: dict, version: int) -> Any:
    cfg = {"fleet": {"kind": "registry", "options": {"url": reg.url, "api_key": KEY,
                                                     "trainer_key": TRAINER}},
           "transport": "http", "sync": {"progress": "off", "failure_policy": "continue"},
           "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}}
    with WeightSync.from_config(cfg) as sync:
        return sync.push(perturb(sd, version), version=version), sync.fleet_version()


def test_a_registry_restart_does_not_hand_a_name_to_the_next_registrant(
        fleet: tuple[Registry, EngineProcess, dict], tmp_path: Path) -> None:
    reg, victim, sd = fleet
    report, _ = _push(reg, sd, 1)
    assert report.engines["victim"].status == "verified"
    assert victim.proc is not None
    os.kill(victim.proc.pid, signal.SIGSTOP)              # the rogue asks first, surely
    reg.proc.kill()                                       # SIGKILL: no goodbye
    reg.start()                                           # same port, same state file
    rogue = RegistryClient(reg.url, KEY)
    with pytest.raises(RegistryError, match="HTTP 409.*belongs to another member's credential"):
        rogue.register({"name": "victim", "url": "http://127.0.0.1:9"})
    os.kill(victim.proc.pid, signal.SIGCONT)
    wait_for(lambda: (member(reg.view(), "victim") or {}).get("state") == "live",
             what="victim registered again with its own credential")
    report, labels = _push(reg, sd, 2)
    assert labels == 2 and report.engines["victim"].status == "verified"
    assert victim.holds(perturb(sd, 2)) and victim.health()["version"] == 2


def test_a_member_frozen_past_its_lease_keeps_its_name_and_comes_back(
        fleet: tuple[Registry, EngineProcess, dict]) -> None:
    reg, victim, sd = fleet
    assert victim.proc is not None
    os.kill(victim.proc.pid, signal.SIGSTOP)
    wait_for(lambda: member(reg.view(), "victim")["state"] == "lapsed", what="victim lapsed")
    rogue = RegistryClient(reg.url, KEY)
    with pytest.raises(RegistryError, match="HTTP 409.*belongs to another member's credential"):
        rogue.register({"name": "victim", "url": "http://127.0.0.1:9"})
    os.kill(victim.proc.pid, signal.SIGCONT)
    wait_for(lambda: member(reg.view(), "victim")["state"] == "live", what="victim back")
    report, _ = _push(reg, sd, 1)
    assert report.engines["victim"].status == "verified" and victim.holds(perturb(sd, 1))
    assert victim.health()["fleet"] is None               # nothing is wrong with its membership


def test_a_dead_members_name_is_released_after_its_grace_and_not_before(
        fleet: tuple[Registry, EngineProcess, dict]) -> None:
    """A member that died for good (SIGKILL, no credential file to come back with): another
    member takes its name only once nothing was heard from it for RELEASE_LEASES leases."""
    from weightsync.fleets.roster import RELEASE_LEASES
    import time
    reg, victim, _ = fleet
    victim.kill()
    died = time.monotonic()
    heir = RegistryClient(reg.url, KEY)
    wait_for(lambda: member(reg.view(), "victim")["state"] == "lapsed", what="victim lapsed")
    with pytest.raises(RegistryError, match="HTTP 409.*belongs to another member's credential"):
        heir.register(HEIR)
    grace = RELEASE_LEASES * LEASE
    got = wait_for(lambda: _try_register(heir), timeout=grace + 30,
                   what="the name released")
    assert time.monotonic() - died >= grace - LEASE      # not before its grace (less one lease)
    assert got["member"]["name"] == "victim" and len(got["credential"]) >= 24


# a disk-pulling host: registered without a health check of an engine behind it
HEIR = {"name": "victim", "url": "http://127.0.0.1:9", "role": "host"}


def _try_register(client: RegistryClient) -> dict[str, Any] | None:
    try:
        return client.register(HEIR)
    except RegistryError:
        return None


def test_a_member_claiming_a_huge_version_sets_no_label(
        fleet: tuple[Registry, EngineProcess, dict], tmp_path: Path) -> None:
    """A rogue engine that says it holds 2**63 - 1 joins a fleet nothing was pushed to yet: the
    trainer's next label comes from what most engines hold, and after a push, from the
    registry's record."""
    reg, victim, sd = fleet
    liar = subprocess.Popen([sys.executable, "-c", LIAR, str(port := free_port())])
    try:
        wait_for(lambda: _up(port), what="liar up")
        RegistryClient(reg.url, KEY).register({"name": "liar", "url": f"http://127.0.0.1:{port}"})
        second = EngineProcess(victim.model_dir, name="honest", log=tmp_path / "honest.log",
                               extra_args=["--fleet", reg.url, "--fleet-key", KEY]).start()
        try:
            wait_for(lambda: (member(reg.view(), "honest") or {}).get("state") == "live",
                     what="honest registered")
            cfg = {"fleet": {"kind": "registry", "options": {"url": reg.url, "api_key": KEY,
                                                             "trainer_key": TRAINER}},
                   "sync": {"progress": "off"}}
            with WeightSync.from_config(cfg) as sync:
                assert sync.fleet_version() == 0
        finally:
            second.stop()
    finally:
        liar.kill()
        liar.wait()
    assert held_by_most([2**63 - 1, 0, 0]) == 0 and held_by_most([7]) == 7
    assert held_by_most([None, 3, 2**62]) == 3 and held_by_most([]) is None


def _up(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except requests.RequestException:
        return False


# an "engine" that answers /health with a version it does not hold
LIAR = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        raw = json.dumps({"status": "ok", "version": 2**63 - 1}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(raw)))
        self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(raw)
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
