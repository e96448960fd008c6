"""A trainer restart is a non-event, with real engines: the registry comes back at its configured
address with the fleet's version from its state file, members register again at their next
heartbeat, `WeightSync.fleet_version()` tells the resumed trainer where the fleet is, and a round
the dead trainer left open (lease still running) is waited out instead of failing the push."""

from __future__ import annotations

from pathlib import Path

import requests
import torch
from weightsync import WeightSync
from weightsync.fleets.client import RegistryClient
from weightsync_reference.processes import EngineProcess
from weightsync.net.server import free_port
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model
from weightsync.testing.waiting import wait_for

KEY = "restart-fleet-key-0123456789"



def registered(url: str, name: str) -> bool:
    try:
        return any(m["name"] == name for m in RegistryClient(url, KEY).fleet()["members"])
    except Exception:  # noqa: BLE001 - not up yet
        return False


def test_a_restarted_trainer_resumes_the_fleet(tmp_path: Path) -> None:
    sd = sample_state_dict()
    model = write_weights_only_model(tmp_path / "m", sd)
    port = free_port()
    cfg = {"fleet": {"kind": "registry",
                     "options": {"port": port, "api_key": KEY, "lease": 2.0,
                                 "state_file": str(tmp_path / "fleet.json")}},
           "transport": "http", "sync": {"progress": "off", "lease": 3.0},
           "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}}
    url = f"http://127.0.0.1:{port}"
    e = EngineProcess(model, name="e", log=tmp_path / "e.log",
                      extra_args=["--fleet", url, "--fleet-key", KEY])
    try:
        with WeightSync.from_config(cfg) as first:
            e.start()
            wait_for(lambda: registered(url, "e"), what="e registered")
            assert first.fleet_version() == 0
            for v in (1, 2):
                assert first.push(perturb(sd, v), version=v).ok
        with WeightSync.from_config(cfg) as second:       # same address, same state file
            assert second.fleet_url == url
            assert second.fleet_version() == 2            # from the state file
            wait_for(lambda: registered(url, "e"), what="e registered again")
            v = (second.fleet_version() or 0) + 1
            assert v == 3
            # the first trainer died inside its push: a round stays open under its lease
            r = requests.post(e.url + "/weightsync/begin", timeout=10,
                              json={"version": 3, "lease": 3.0, "transport": {"kind": "http"},
                                    "encoding": {"kind": "raw"}})
            assert r.status_code == 200, r.text
            assert e.health()["round"]["version"] == 3
            state = perturb(sd, v)
            report = second.push(state, version=v)     # failure_policy raise: it must succeed
            assert report.ok and report.verified, report.summary()
            got = e.weights()
            assert all(torch.equal(got[n], t) for n, t in state.items())
            assert RegistryClient(url, KEY).fleet()["version"] == 3
    finally:
        e.stop()
