"""The fleet registry with real processes: members register themselves (`weightsync serve
--fleet`), heartbeat, lapse, come back and catch up from a peer; bad registrations get clear
errors; a peer serving corrupted bytes is caught and nothing bad is committed; `weightsync fleet
ls` and GET /fleet show the members."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from weightsync import WeightSync
from weightsync.fleets.client import RegistryClient, RegistryError
from weightsync_reference.processes import EngineProcess
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model
from weightsync.testing.waiting import fleet_member as member
from weightsync.testing.waiting import wait_for

KEY = "fleet-key-0123456789"




def fleet_cfg(**opts: Any) -> dict[str, Any]:
    return {"fleet": {"kind": "registry", "options": {"lease": 1.5, "api_key": KEY, **opts}},
            "transport": "http", "sync": {"progress": "off", "failure_policy": "continue"},
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}}


def test_members_register_lapse_come_back_and_catch_up_from_a_peer(tmp_path: Path) -> None:
    sd = sample_state_dict()
    model = write_weights_only_model(tmp_path / "m", sd)
    with WeightSync.from_config(fleet_cfg()) as sync:
        url = sync.fleet_url
        reg = RegistryClient(url, KEY)
        a = EngineProcess(model, name="a", log=tmp_path / "a.log",
                          extra_args=["--fleet", url, "--fleet-key", KEY]).start()
        b = EngineProcess(model, name="b", log=tmp_path / "b.log",   # its credential kept: b,
                          extra_args=["--fleet", url, "--fleet-key", KEY,   # killed, comes back
                                      "--fleet-credential-file", str(tmp_path / "b.credential")]
                          ).start()
        try:
            wait_for(lambda: len(reg.fleet()["members"]) == 2, what="two members")
            states = {}
            for v in (1, 2):
                states[v] = perturb(sd, v)
                r = sync.push(states[v], version=v)
                assert r.ok and set(r.engines) == {"a", "b"}, r.summary()
            assert r.joined == [] and r.left == []
            # b dies: its lease lapses, the next push excludes it and says why
            b.kill()
            wait_for(lambda: member(reg.fleet(), "b")["state"] == "lapsed", what="b lapsed")
            states[3] = perturb(sd, 3)
            r = sync.push(states[3], version=3)
            assert r.ok and set(r.engines) == {"a"} and "b" in r.excluded
            assert "lease" in r.excluded["b"]
            # b comes back at version 0: it pulls version 3 from a, not from the trainer
            b.start()
            m = wait_for(lambda: (x := member(reg.fleet(), "b")) and x["state"] == "live"
                         and x["version"] == 3 and x, what="b caught up")
            assert m["pulled_from_peer"] == 1 and m["via"] == "a"
            h = b.health()
            assert h["version"] == 3 and h["peer"]["pulled"] == 1 and a.health()["peer"]["served_buckets"] > 0
            got = b.weights()
            assert all(torch.equal(got[n], t) for n, t in states[3].items())
            states[4] = perturb(sd, 4)
            r = sync.push(states[4], version=4)
            assert r.ok and set(r.engines) == {"a", "b"} and r.joined == ["b"]
            assert not r.engines["b"].caught_up
            for e in (a, b):
                got = e.weights()
                assert all(torch.equal(got[n], t) for n, t in states[4].items())
            # SIGTERM: the engine deregisters itself
            a.stop()
            wait_for(lambda: member(reg.fleet(), "a") is None, what="a deregistered")
        finally:
            a.stop()
            b.stop()


def test_bad_registrations_are_refused_clearly(tmp_path: Path) -> None:
    sd = sample_state_dict()
    model = write_weights_only_model(tmp_path / "m", sd)
    with WeightSync.from_config(fleet_cfg()) as sync, \
            EngineProcess(model, name="e", log=tmp_path / "e.log") as e:
        reg = RegistryClient(sync.fleet_url, KEY)
        ok = {"name": "e", "url": e.url}
        with pytest.raises(RegistryError, match="HTTP 401.*missing or wrong API key"):
            RegistryClient(sync.fleet_url, "wrong").register(ok)
        with pytest.raises(RegistryError, match="unknown adapter 'nope'; installed: .*reference"):
            reg.register({**ok, "adapter": {"kind": "nope"}})
        with pytest.raises(RegistryError, match="cannot be reached"):
            reg.register({"name": "ghost", "url": "http://127.0.0.1:9"})
        with pytest.raises(RegistryError, match="member name"):
            reg.register({**ok, "name": "../evil"})
        with pytest.raises(RegistryError, match="bad options"):
            reg.register({**ok, "options": {"timeuot": 3}})
        reg.register(ok)
        with pytest.raises(RegistryError, match="HTTP 409.*already registered at"):
            reg.register({"name": "e", "url": "http://127.0.0.1:1"})
        with pytest.raises(RegistryError, match="HTTP 404.*not registered"):
            reg.heartbeat("nobody")
        r = requests.get(sync.fleet_url + "/fleet", timeout=5)
        assert r.status_code == 401
        view = reg.fleet()
        assert [m["name"] for m in view["members"]] == ["e"] and "registration" not in view["members"][0]


class CorruptingProxy:
    """A man in the middle in front of a real engine: forwards every request, but flips one byte
    in the payload frames its peer route serves (corruption in transit, or a broken host)."""

    def __init__(self, target: str) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        proxy = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _forward(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                r = requests.request(method, target + self.path, data=body, headers=headers, timeout=60)
                data = bytearray(r.content)
                if self.path.startswith("/weightsync/peer/bucket") and r.status_code == 200:
                    data[-3] ^= 0x10
                    proxy.corrupted += 1
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(bytes(data))

            def do_GET(self) -> None:  # noqa: N802
                self._forward("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._forward("POST")

        self.corrupted = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_a_peer_serving_corrupted_bytes_is_caught_and_nothing_bad_is_committed(tmp_path: Path) -> None:
    sd = sample_state_dict()
    model = write_weights_only_model(tmp_path / "m", sd)
    engines: list[EngineProcess] = []

    def start(name: str, register: bool = True) -> EngineProcess:
        args = ["--fleet", url, "--fleet-key", KEY] if register else []
        e = EngineProcess(model, name=name, log=tmp_path / f"{name}.log", extra_args=args).start()
        engines.append(e)
        return e
    with WeightSync.from_config(fleet_cfg()) as sync:
        url = sync.fleet_url
        reg = RegistryClient(url, KEY)
        proxy = None
        try:
            good = start("z-good")
            hidden = start("bad", register=False)           # behind the corrupting proxy
            proxy = CorruptingProxy(hidden.url)
            from weightsync.fleets.member import Membership
            keep = Membership(url, KEY, {"name": "a-bad", "url": proxy.url}, lambda: hidden.health()["version"])
            keep.start()
            wait_for(lambda: len(reg.fleet()["members"]) == 2, what="two members")
            v1 = perturb(sd, 1)
            r = sync.push(v1, version=1)
            assert r.ok and set(r.engines) == {"a-bad", "z-good"}
            # a joiner: the corrupted peer is tried first (by name), caught, then the good one
            j = start("j")
            m = wait_for(lambda: (x := member(reg.fleet(), "j")) and x["state"] == "live" and x,
                         what="j caught up")
            assert proxy.corrupted >= 1 and m["via"] == "z-good" and m["version"] == 1
            got = j.weights()
            assert all(torch.equal(got[n], t) for n, t in v1.items())
            assert j.health()["peer"]["pulled"] == 1
            # only the corrupted peer left: the joiner refuses it, stays whole at version 0, is
            # marked behind, and the trainer's next push brings it up
            good.stop()
            j.stop()
            wait_for(lambda: member(reg.fleet(), "z-good") is None and member(reg.fleet(), "j") is None,
                     what="the good peers left")
            j2 = start("j2")
            m = wait_for(lambda: (x := member(reg.fleet(), "j2")) and x["state"] == "behind" and x,
                         what="j2 behind")
            assert "differ" in (m["error"] or "") or "digest" in (m["error"] or ""), m["error"]
            assert j2.health()["version"] == 0 and j2.health()["round"] is None
            got = j2.weights()
            assert all(torch.equal(got[n], t) for n, t in sd.items())     # never a bad byte
            v2 = perturb(sd, 2)
            r = sync.push(v2, version=2)
            assert r.engines["j2"].ok and r.engines["j2"].version == 2
            got = j2.weights()
            assert all(torch.equal(got[n], t) for n, t in v2.items())
            wait_for(lambda: (x := member(reg.fleet(), "j2")) and x["state"] == "live"
                     and x["version"] == 2 and not x["error"], what="j2 live again after the push")
            keep.stop()
        finally:
            if proxy is not None:
                proxy.close()
            for e in engines:
                e.stop()


def test_fleet_ls_prints_members_and_json(tmp_path: Path) -> None:
    sd = sample_state_dict()
    model = write_weights_only_model(tmp_path / "m", sd)
    with WeightSync.from_config(fleet_cfg()) as sync, \
            EngineProcess(model, name="e1", log=tmp_path / "e.log",
                          extra_args=["--fleet", sync.fleet_url, "--fleet-key", KEY]) as e:
        reg = RegistryClient(sync.fleet_url, KEY)
        wait_for(lambda: member(reg.fleet(), "e1"), what="e1 registered")
        sync.push(perturb(sd, 1), version=1)
        env = {**os.environ, "WEIGHTSYNC_FLEET_KEY": KEY}
        out = subprocess.run([sys.executable, "-m", "weightsync", "fleet", "ls", "--registry",
                              sync.fleet_url], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("fleet version 1, lease 1.5s, 1 members")
        row = next(line for line in lines if line.startswith("e1 "))
        assert "reference" in row and " 1 " in row and "live" in row and e.url in row
        out = subprocess.run([sys.executable, "-m", "weightsync", "fleet", "ls", "--registry",
                              sync.fleet_url, "--json"], capture_output=True, text=True, env=env, timeout=60)
        view = json.loads(out.stdout)
        assert view == {**view, "version": 1} and view["members"][0]["name"] == "e1"
        assert set(view["members"][0]) >= {"name", "url", "adapter", "version", "state", "lease_left"}
        bad = subprocess.run([sys.executable, "-m", "weightsync", "fleet", "ls", "--registry",
                              sync.fleet_url], capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_FLEET_KEY"})
        assert bad.returncode == 2 and "HTTP 401" in bad.stderr and "Traceback" not in bad.stderr
