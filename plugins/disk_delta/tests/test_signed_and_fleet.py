"""Signed manifests (an HMAC key shared by the publisher and the agents): a forged version on
the shared root fails loudly and nothing is applied; and an agent shows its host in a fleet
registry (role `host`, with the version its local checkpoint holds)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightsync import WeightSync
from weightsync.errors import WeightSyncError
from weightsync.fleets.client import RegistryClient
from weightsync_disk_delta.agent import Agent
from weightsync_disk_delta.layout import VERSIONS, version_dir_name
from weightsync_disk_delta.testing import Trainer, bit_equal, publish_config

KEY = "a-shared-hmac-key-0123456789"


def _manifest(root: Path, v: int) -> Path:
    return root / VERSIONS / version_dir_name(v) / "manifest.json"


def test_signed_manifests_refuse_a_forged_version(tmp_path: Path) -> None:
    tr = Trainer(tmp_path / "model")
    root = tmp_path / "root"
    keyfile = tmp_path / "hmac.key"
    keyfile.write_text(KEY)
    cfg = publish_config(root)
    cfg["transport"]["options"]["hmac_key_file"] = str(keyfile)
    with WeightSync.from_config(cfg) as sync:
        tr.step()
        s1 = tr.state()
        assert sync.push(s1, version=1).ok
        tr.step()
        s2 = tr.state()
        assert sync.push(s2, version=2).ok
    assert "sig" in json.loads(_manifest(root, 1).read_text())
    agent = Agent(root, tmp_path / "local", None, hmac_key=KEY.encode())
    assert agent.sync_local(1) == 1 and bit_equal(agent.local.tensors(), s1) == []
    # a forger rewrites version 2's manifest (here: another digest) without the key
    m = json.loads(_manifest(root, 2).read_text())
    name = next(iter(m["tensors"]))
    m["tensors"][name]["digest"] = "0" * 32
    _manifest(root, 2).write_text(json.dumps(m))
    with pytest.raises(WeightSyncError, match="the manifest has a wrong signature"):
        agent.sync_local(2)
    del m["sig"]
    _manifest(root, 2).write_text(json.dumps(m))
    with pytest.raises(WeightSyncError, match="the manifest is not signed"):
        agent.sync_local(2)
    assert agent.local.version == 1 and bit_equal(agent.local.tensors(), s1) == []
    # without a key the agent does not check signatures (and still checks every digest)
    plain = Agent(root, tmp_path / "plain", None)
    assert plain.sync_local(1) == 1
    # a signature does not prove freshness: a `latest` older than the fleet's version (a stale
    # or rolled-back root, validly signed) is refused when the registry reports a newer one
    fresh = Agent(root, tmp_path / "fresh", None, hmac_key=KEY.encode())
    fresh.floor = lambda: 3
    with pytest.raises(WeightSyncError, match="older than version 3 the fleet registry reports"):
        fresh.sync_local()
    assert fresh.local.version is None


def test_an_agent_shows_its_host_in_the_fleet(tmp_path: Path) -> None:
    tr = Trainer(tmp_path / "model")
    root = tmp_path / "root"
    fleet_key = "fleet-key-for-the-hosts-0123"
    reg_cfg = {"fleet": {"kind": "registry", "options": {"api_key": fleet_key, "lease": 2}},
               "engines": [], "sync": {"progress": "off"}}
    with WeightSync.from_config(publish_config(root)) as pub, \
            WeightSync.from_config(reg_cfg) as registry_owner:
        tr.step()
        assert pub.push(tr.state(), version=1).ok
        url = registry_owner.fleet_url
        agent = subprocess.Popen([sys.executable, "-m", "weightsync_disk_delta.cli", "agent",
                                  "--root", str(root), "--local", str(tmp_path / "local"),
                                  "--engine", "none", "--interval", "0.1", "--timeout", "60",
                                  "--fleet", url, "--fleet-key", fleet_key, "--name", "host-a"],
                                 stdout=open(tmp_path / "agent.log", "w"), stderr=subprocess.STDOUT)
        try:
            reg = RegistryClient(url, fleet_key)
            deadline = time.monotonic() + 60
            seen = None
            while time.monotonic() < deadline:
                seen = next((m for m in reg.fleet()["members"] if m["name"] == "host-a"), None)
                if seen and seen["version"] == 1:
                    break
                time.sleep(0.1)
            assert seen and seen["role"] == "host" and seen["version"] == 1, seen
            assert registry_owner.fleet.members() == []          # a host is never pushed to
        finally:
            agent.terminate()
            agent.wait(30)


def test_the_agent_signs_what_it_loads_into_an_engine_holding_the_key(tmp_path: Path) -> None:
    """A reference engine with an HMAC key loads only signed checkpoints; the agent, which checked
    every signed manifest, signs the local checkpoint it hands the engine."""
    from weightsync_reference.adapter import ReferenceAdapter
    from weightsync.config import EngineSpec
    from weightsync_reference.processes import EngineProcess
    from weightsync_disk_delta.testing import weights_only
    tr = Trainer(tmp_path / "model")
    served = weights_only(tmp_path / "model", tmp_path / "served")
    root = tmp_path / "root"
    keyfile = tmp_path / "hmac.key"
    keyfile.write_text(KEY)
    cfg = publish_config(root)
    cfg["transport"]["options"]["hmac_key_file"] = str(keyfile)
    with WeightSync.from_config(cfg) as sync:
        tr.step()
        assert sync.push(tr.state(), version=1).ok
    with EngineProcess(served, log=tmp_path / "e.log", load_roots=[str(tmp_path)],
                       extra_args=["--hmac-key-file", str(keyfile)]) as e:
        adapter = ReferenceAdapter(None, EngineSpec(url=e.url))
        try:
            unsigned = Agent(root, tmp_path / "unsigned", adapter)      # holds no key: refused
            with pytest.raises(WeightSyncError, match="is not signed"):
                unsigned.step()
            agent = Agent(root, tmp_path / "local", adapter, hmac_key=KEY.encode())
            assert agent.step() == (1, 1)
            assert e.health()["version"] == 1 and bit_equal(e.weights(), tr.state()) == []
        finally:
            adapter.close()
