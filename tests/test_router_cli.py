"""`weightsync route` as docs/rl.md shows it, against a keyed registry process and real keyed
engines (issue 39): it follows the fleet with the registry's router key, which reads only the
members' rollout keys (generation, never a weight route, never the engine keys or a push report);
it serves generation only to callers with its own key, and refuses to start without one unless
told `--insecure`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import requests

from weightsync.net.process import ServerProcess
from weightsync.net.server import free_port
from weightsync_reference.models import build_tiny_model
from weightsync.testing.waiting import wait_for
from weightsync_reference.processes import EngineProcess

FLEET, TRAINER, ROUTER = "route-fleet-key-012345", "route-trainer-key-012345", "route-key-0123456789"
READER, ENGINE, ROLLOUT = "route-reader-key-012345", "engine-key-0123456789ab", "rollout-key-0123456789"


def test_route_follows_a_keyed_registry_with_a_generation_only_key(tmp_path: Path) -> None:
    keys = {"fleet": FLEET, "trainer": TRAINER, "router": ROUTER, "reader": READER,
            "rollout": ROLLOUT}
    for name, key in keys.items():
        (tmp_path / f"{name}.key").write_text(key)
    build_tiny_model(tmp_path / "m", "llama", hidden=32, intermediate=64, layers=1)
    reg_port, route_port = free_port(), free_port()
    registry = ServerProcess("registry", tmp_path / "registry.log")
    router = ServerProcess("router", tmp_path / "router.log")
    reg = f"http://127.0.0.1:{reg_port}"
    engine = EngineProcess(tmp_path / "m", name="e0", log=tmp_path / "e0.log", api_key=ENGINE,
                           extra_args=["--fleet", reg, "--fleet-key", FLEET,
                                       "--rollout-key-file", str(tmp_path / "rollout.key")])
    try:
        registry.launch([sys.executable, "-m", "weightsync", "fleet", "serve", "--port",
                         str(reg_port), "--api-key-file", str(tmp_path / "fleet.key"),
                         "--trainer-key-file", str(tmp_path / "trainer.key"),
                         "--router-key-file", str(tmp_path / "reader.key")])
        registry.wait_healthy(reg + "/health", timeout=60)
        engine.start(timeout=120)
        router.launch([sys.executable, "-m", "weightsync", "route", "--fleet", reg, "--fleet-key",
                       FLEET, "--fleet-router-key-file", str(tmp_path / "reader.key"),
                       "--api-key-file", str(tmp_path / "router.key"), "--port", str(route_port)])
        url = f"http://127.0.0.1:{route_port}"
        router.wait_healthy(url + "/health", timeout=60)
        auth = {"Authorization": f"Bearer {ROUTER}"}
        wait_for(lambda: requests.get(url + "/members", headers=auth, timeout=5).json()["members"],
                 what="the router sees the engine")
        body = {"prompts": [[1, 2, 3]], "sampling": {"n": 2, "max_new_tokens": 3}, "wait": 30}
        r = requests.post(url + "/generate", json=body, headers=auth, timeout=120)
        assert r.status_code == 200, r.text
        assert [s["engine"] for s in r.json()["samples"]] == ["e0", "e0"]
        r = requests.post(url + "/generate", json=body, timeout=30)
        assert r.status_code == 401

        # what the router's key opens at the registry: the rollout keys, nothing else
        fleet = {"Authorization": f"Bearer {FLEET}"}
        as_router = {**fleet, "X-Weightsync-Router": READER}
        view = requests.get(reg + "/fleet?rollouts=1", headers=as_router, timeout=10)
        assert view.status_code == 200 and ENGINE not in view.text, view.text
        assert view.json()["members"][0]["rollout"]["api_key"] == ROLLOUT
        r = requests.get(reg + "/fleet?with_keys=1", headers=as_router, timeout=10)
        assert r.status_code == 403 and "trainer only" in r.json()["error"], r.text
        r = requests.post(reg + "/fleet/synced", json={"version": 9, "versions": {}},
                          headers=as_router, timeout=10)
        assert r.status_code == 403, r.text
        r = requests.get(reg + "/fleet?rollouts=1", headers=fleet, timeout=10)
        assert r.status_code == 403 and "router key" in r.json()["error"], r.text
        # and what the rollout key opens at the engine: generation, never a weight route
        with_rollout = {"Authorization": f"Bearer {ROLLOUT}"}
        r = requests.post(engine.url + "/weightsync/begin", json={"version": 1, "plan": {}},
                          headers=with_rollout, timeout=10)
        assert r.status_code == 401, r.text
        r = requests.post(engine.url + "/generate", json={"input_ids": [1, 2], "max_new_tokens": 1},
                          headers=with_rollout, timeout=60)
        assert r.status_code == 200, r.text
        assert engine.health()["version"] == 0
    finally:
        router.stop()
        engine.stop()
        registry.stop()


def test_route_refuses_to_start_without_a_key(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "weightsync", "route", "--engine",
                        "http://127.0.0.1:9", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 2 and "the router has no key" in r.stderr, r.stderr
