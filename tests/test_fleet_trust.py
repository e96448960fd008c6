"""Fleet trust, attacked with real processes on 127.0.0.1: a process holding only the fleet key
registers itself and nothing more. It cannot read another member's engine key, report pushes,
heartbeat, deregister or take over another member's name; a registry does not run without a key;
a registry started on its own hands engine keys only to the trainer's key."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
import torch
from weightsync import WeightSync
from weightsync.errors import ConfigError
from weightsync.fleets.client import RegistryClient, RegistryError
from weightsync_reference.processes import EngineProcess
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model
from weightsync.testing.waiting import fleet_member as member
from weightsync.testing.waiting import wait_for

KEY = "fleet-key-0123456789"
ENGINE_KEY = "victim-engine-key-0123456789"




def fleet_cfg(**opts: Any) -> dict[str, Any]:
    return {"fleet": {"kind": "registry", "options": {"lease": 5.0, "api_key": KEY, **opts}},
            "transport": "http", "sync": {"progress": "off", "failure_policy": "continue"},
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = sample_state_dict()
    return write_weights_only_model(tmp_path_factory.mktemp("trust") / "m", sd), sd


@pytest.fixture(scope="module")
def engine(model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """An engine that registers with whatever registry a test names (started unregistered)."""
    e = EngineProcess(model[0], name="victim", api_key=ENGINE_KEY,
                      log=tmp_path_factory.mktemp("trust-log") / "victim.log").start()
    yield e
    e.stop()


def test_a_fleet_key_holder_acts_only_as_itself(model: Any, engine: EngineProcess) -> None:
    sd = model[1]
    with WeightSync.from_config(fleet_cfg(lease=5.0)) as sync:
        url = sync.fleet_url
        victim = RegistryClient(url, KEY)
        out = victim.register({"name": "victim", "url": engine.url, "api_key": ENGINE_KEY})
        cred = out["credential"]
        assert len(cred) >= 24
        rogue = RegistryClient(url, KEY)
        # no route hands the rogue the victim's engine key
        with pytest.raises(RegistryError, match="HTTP 403.*trainer only"):
            rogue._call("GET", "/fleet?with_keys=1")
        r = requests.get(url + "/fleet?with_keys=1", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=5)
        assert r.status_code == 403 and ENGINE_KEY not in r.text
        assert ENGINE_KEY not in requests.get(url + "/fleet", timeout=5,
                                              headers={"Authorization": f"Bearer {KEY}"}).text
        # it cannot act as the victim: deregister, heartbeat, take the name, report a push
        for cred_try in (None, "a" * 32):
            with pytest.raises(RegistryError, match="HTTP 403.*another credential"):
                rogue.deregister("victim", cred_try)
            with pytest.raises(RegistryError, match="HTTP 403.*another credential"):
                rogue.heartbeat("victim", 10**6, cred_try)
        with pytest.raises(RegistryError, match="HTTP 409.*already registered"):
            rogue.register({"name": "victim", "url": "http://127.0.0.1:9"})
        with pytest.raises(RegistryError, match="HTTP 409.*already registered"):
            rogue.register({"name": "victim", "url": engine.url})     # same URL, no credential
        with pytest.raises(RegistryError, match="HTTP 403.*trainer only"):
            rogue.synced(10**6, {"victim": 10**6})
        view = rogue.fleet()
        assert view["version"] is None and member(view, "victim")["version"] == 0
        # the victim itself still heartbeats and re-registers with its own credential
        assert victim.heartbeat("victim", 0, cred)["state"] == "live"
        assert victim.register({"name": "victim", "url": engine.url, "api_key": ENGINE_KEY},
                               cred)["credential"] == cred
        v1 = perturb(sd, 1)
        r = sync.push(v1, version=1)
        assert r.ok and set(r.engines) == {"victim"} and r.engines["victim"].status == "verified"
        got = engine.weights()
        assert all(torch.equal(got[n], t) for n, t in v1.items())
        victim.deregister("victim", cred)
        wait_for(lambda: member(victim.fleet(), "victim") is None, what="victim deregistered")


def test_a_registry_never_runs_open(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("WEIGHTSYNC_FLEET_KEY", raising=False)
    cfg = fleet_cfg()
    del cfg["fleet"]["options"]["api_key"]
    with pytest.raises(ConfigError, match="registry has no key.*insecure: true"):
        WeightSync.from_config(cfg)
    cfg["fleet"]["options"]["insecure"] = True
    with WeightSync.from_config(cfg) as sync:              # said in so many words: it runs
        assert requests.get(sync.fleet_url + "/fleet", timeout=5).status_code == 200
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_FLEET_KEY"}
    out = subprocess.run([sys.executable, "-m", "weightsync", "fleet", "serve", "--port", "0"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "registry has no key" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_registry_on_its_own_gives_engine_keys_only_to_the_trainer(
        model: Any, engine: EngineProcess, tmp_path: Path) -> None:
    sd = model[1]
    (tmp_path / "fleet.key").write_text(KEY)
    (tmp_path / "trainer.key").write_text("trainer-key-0123456789abcdef")
    proc = subprocess.Popen([sys.executable, "-m", "weightsync", "fleet", "serve", "--port", "0",
                             "--api-key-file", str(tmp_path / "fleet.key"), "--trainer-key-file",
                             str(tmp_path / "trainer.key"), "--lease", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = ""
        for _ in range(200):                        # bounded: the first lines it prints
            line = proc.stdout.readline()
            if "serving on" in line or not line:
                break
        m = re.search(r"serving on (http://\S+)", line)
        assert m, line
        url = m.group(1)
        victim = RegistryClient(url, KEY)
        cred = victim.register({"name": "victim", "url": engine.url,
                                "api_key": ENGINE_KEY})["credential"]
        with pytest.raises(RegistryError, match="HTTP 403.*trainer only"):
            victim._call("GET", "/fleet?with_keys=1")
        cfg = fleet_cfg(url=url, trainer_key_file=str(tmp_path / "trainer.key"))
        with WeightSync.from_config(cfg) as sync:
            v = max(engine.health()["version"], 0) + 1
            state = perturb(sd, v)
            r = sync.push(state, version=v)
            assert r.ok and set(r.engines) == {"victim"}
            assert RegistryClient(url, KEY).fleet()["version"] == v
        victim.deregister("victim", cred)
    finally:
        proc.terminate()
        proc.wait(10)


def test_peer_join_is_anchored_in_the_trainers_digests(model: Any, tmp_path: Path) -> None:
    """A rogue member holding other weights under the fleet's version serves a joiner a
    manifest that matches its own bytes: the joiner checks against the trainer's digests,
    names the liar, and takes the version from an honest peer (or waits for the next push)."""
    from weightsync.fleets.member import Membership
    from weightsync_reference.processes import start_all
    path, sd = model
    with WeightSync.from_config(fleet_cfg(lease=3.0)) as sync:
        url = sync.fleet_url
        reg = RegistryClient(url, KEY)
        fleet_args = ["--fleet", url, "--fleet-key", KEY]
        good = EngineProcess(path, name="z-good", log=tmp_path / "good.log", extra_args=fleet_args)
        liar = EngineProcess(path, name="a-liar", log=tmp_path / "liar.log", load_roots=[str(tmp_path)])
        joiners: list[EngineProcess] = []
        keep = None
        try:
            start_all([good, liar])
            wait_for(lambda: member(reg.fleet(), "z-good"), what="z-good registered")
            v1 = perturb(sd, 1)
            assert sync.push(v1, version=1).ok
            # the liar: other weights, labelled as the fleet's version 1
            other = tmp_path / "other"
            other.mkdir()
            from safetensors.torch import save_file
            save_file({k: v.contiguous() for k, v in perturb(sd, 77).items()},
                      str(other / "model.safetensors"))
            r = requests.post(liar.url + "/weightsync/load_from_disk", timeout=60,
                              json={"path": str(other), "version": 1})
            assert r.status_code == 200, r.text
            keep = Membership(url, KEY, {"name": "a-liar", "url": liar.url},
                              lambda: liar.health()["version"]).start()
            j = EngineProcess(path, name="j", log=tmp_path / "j.log", extra_args=fleet_args).start()
            joiners.append(j)
            m = wait_for(lambda: (x := member(reg.fleet(), "j")) and x["state"] == "live"
                         and x["version"] == 1 and x, what="j caught up")
            assert m["via"] == "z-good" and liar.health()["peer"]["served_buckets"] > 0
            got = j.weights()
            assert all(torch.equal(got[n], t) for n, t in v1.items())
            # one-time share tokens, bound to a version: opened as the registry does
            tok = "t" * 32
            assert requests.post(good.url + "/weightsync/peer/share", timeout=10,
                                 json={"token": tok, "ttl": 600}).status_code == 200
            hdr = {"X-Weightsync-Share": tok}
            man = requests.get(good.url + "/weightsync/peer/manifest", headers=hdr, timeout=10)
            assert man.status_code == 200
            again = requests.get(good.url + "/weightsync/peer/manifest", headers=hdr, timeout=10)
            assert again.status_code == 401 and "already served the manifest" in again.text
            n = len(man.json()["buckets"])
            for i in range(n):
                b = requests.get(good.url + "/weightsync/peer/bucket", headers=hdr, timeout=10,
                                 params={"index": i, "version": 1})
                assert b.status_code == 200
            b = requests.get(good.url + "/weightsync/peer/bucket", headers=hdr, timeout=10,
                             params={"index": 0, "version": 1})
            assert b.status_code == 401                      # the pull ended: the token died
            tok2 = "u" * 32
            requests.post(good.url + "/weightsync/peer/share", json={"token": tok2, "ttl": 600},
                          timeout=10)
            assert sync.push(perturb(sd, 2), version=2).engines["z-good"].ok
            late = requests.get(good.url + "/weightsync/peer/manifest", timeout=10,
                                headers={"X-Weightsync-Share": tok2})
            assert late.status_code == 409 and "share was for version 1" in late.text
            # only the liar can serve (at the fleet's version): the joiner refuses it by name
            good.stop()
            j.stop()
            wait_for(lambda: member(reg.fleet(), "z-good") is None, what="z-good left")
            r = requests.post(liar.url + "/weightsync/load_from_disk", timeout=60,
                              json={"path": str(other), "version": 2, "allow_older": True})
            assert r.status_code == 200, r.text                # the liar relabels itself
            j2 = EngineProcess(path, name="j2", log=tmp_path / "j2.log", extra_args=fleet_args).start()
            joiners.append(j2)
            m = wait_for(lambda: (x := member(reg.fleet(), "j2")) and x["state"] == "behind" and x,
                         what="j2 behind")
            assert "a-liar" in m["error"] and "other weights than the trainer pushed" in m["error"]
            assert j2.health()["version"] == 0
            got = j2.weights()
            assert all(torch.equal(got[n], t) for n, t in sd.items())     # never the liar's bytes
        finally:
            if keep is not None:
                keep.stop()
            for e in [good, liar, *joiners]:
                e.stop()
