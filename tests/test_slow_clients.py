"""Slow and hostile clients are shed, with real sockets on 127.0.0.1 against real services: a
reference engine process, a registry process (`weightsync fleet serve`) and a body server. 64
connections drip one header byte at a time, clients with no key flood headers, and (on the
engine) key holders announce 16 MiB bodies they never send. Legitimate requests are still
answered, a push still succeeds, the services' memory barely grows, and every dripping connection
is closed by the head deadline although it keeps sending."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import requests

from weightsync import WeightSync
from weightsync.net.bodyserver import BodyServer
from weightsync_reference.processes import EngineProcess
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model

KEY = "slow-clients-key-0123456789"
MiB = 2**20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Attack:
    """Drippers, a header flood with no key, and optional announced-but-unsent bodies."""

    def __init__(self, port: int, path: str, drippers: int = 64, flood: int = 16,
                 announce: int = 0) -> None:
        self.port, self.path = port, path
        self.stop = threading.Event()
        self.drip: list[socket.socket] = []
        self.closed: set[int] = set()
        self.held: list[socket.socket] = []
        for _ in range(drippers):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Drip: ".encode())
            self.drip.append(s)
        for _ in range(announce):          # a key holder announcing bodies it never sends
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(f"POST /weightsync/deliver HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      f"{KEY}\r\nContent-Type: application/json\r\nContent-Length: {16 * MiB}"
                      f"\r\n\r\n".encode())
            self.held.append(s)
        self.threads = [threading.Thread(target=self._drip, daemon=True)]
        self.threads += [threading.Thread(target=self._flood, daemon=True) for _ in range(flood)]
        for t in self.threads:
            t.start()

    def _drip(self) -> None:
        while not self.stop.wait(0.5):      # one byte per connection every half second
            for i, s in enumerate(self.drip):
                if i in self.closed:
                    continue
                try:
                    s.sendall(b"a")
                except OSError:
                    self.closed.add(i)

    def _flood(self) -> None:
        line = b"X-Flood: " + b"f" * (64 * 1024 - 12) + b"\r\n"
        for _ in range(4):                   # a few connections each: 100 lines of 64 KiB
            if self.stop.is_set():
                return
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
                    s.sendall(f"GET {self.path} HTTP/1.1\r\nHost: x\r\n".encode())
                    for _ in range(100):
                        s.sendall(line)
            except OSError:
                pass                         # refused (431) and closed: as it should be

    def all_closed(self, timeout: float) -> bool:
        """Whether every dripping connection was closed by the service (bounded poll)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self.closed) < len(self.drip):
            for i, s in enumerate(self.drip):
                if i not in self.closed:
                    s.setblocking(False)
                    try:
                        if s.recv(1 << 16) == b"":
                            self.closed.add(i)
                    except BlockingIOError:
                        pass
                    except OSError:
                        self.closed.add(i)
            time.sleep(0.1)
        return len(self.closed) == len(self.drip)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        for s in self.drip + self.held:
            s.close()


def served(n: int, call: Callable[[], Any]) -> int:
    ok = 0
    for _ in range(n):
        try:
            ok += call().status_code == 200
        except requests.RequestException:
            pass
    return ok


def test_the_engine_sheds_slow_and_hostile_clients(tmp_path: Path) -> None:
    sd = sample_state_dict()
    model = write_weights_only_model(tmp_path / "m", sd)
    with EngineProcess(model, name="e", api_key=KEY, log=tmp_path / "e.log") as e:
        assert e.proc is not None
        h = {"Authorization": f"Bearer {KEY}"}
        before = rss(e.proc.pid)
        attack = Attack(e.port, "/weightsync/begin", announce=60)
        try:
            ok = served(30, lambda: requests.get(e.url + "/info", headers=h, timeout=10))
            cfg = {"engines": [e.spec()], "transport": "http", "sync": {"progress": "off"},
                   "exporter": {"kind": "torch", "options": {"bucket_bytes": 16 * 1024}}}
            with WeightSync.from_config(cfg) as sync:
                report = sync.push(perturb(sd, 1), version=1)
            grown = rss(e.proc.pid) - before
            assert ok >= 29 and report.ok, (ok, report.summary())
            assert grown < 64 * MiB, grown / MiB
            assert attack.all_closed(timeout=30), f"{len(attack.closed)} of 64 closed"
        finally:
            attack.close()


def test_the_registry_sheds_slow_and_hostile_clients(tmp_path: Path) -> None:
    (tmp_path / "key").write_text(KEY)
    proc = subprocess.Popen([sys.executable, "-m", "weightsync", "fleet", "serve", "--port", "0",
                             "--api-key-file", str(tmp_path / "key")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = ""
        for _ in range(200):
            line = proc.stdout.readline()
            if "serving on" in line or not line:
                break
        m = re.search(r"serving on (http://\S+)", line)
        assert m, line
        url = m.group(1)
        before = rss(proc.pid)
        attack = Attack(int(url.rsplit(":", 1)[1]), "/fleet/register")
        try:
            ok = served(30, lambda: requests.get(url + "/fleet", timeout=10,
                                                 headers={"Authorization": f"Bearer {KEY}"}))
            grown = rss(proc.pid) - before
            assert ok >= 29 and grown < 64 * MiB, (ok, grown / MiB)
            assert attack.all_closed(timeout=30), f"{len(attack.closed)} of 64 closed"
        finally:
            attack.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_body_server_sheds_slow_clients() -> None:
    import torch
    from weightsync.net.bodyserver import fetch
    from weightsync.receive import read_exact
    bs = BodyServer()
    try:
        data = torch.arange(4096, dtype=torch.uint8)
        urls = [bs.publish(data) for _ in range(30)]
        port = int(urls[0]["url"].split(":")[2].split("/")[0])
        attack = Attack(port, "/weightsync/body", drippers=64, flood=4)
        try:
            ok = 0
            for u in urls:
                out = torch.empty(4096, dtype=torch.uint8)
                try:
                    fetch(u, lambda read_into, n: read_exact(read_into, memoryview(out.numpy())),
                          max_bytes=4096, timeout=10)
                    ok += bool(torch.equal(out, data))
                except Exception:  # noqa: BLE001 - counted as not served
                    pass
            assert ok >= 29, ok
            assert attack.all_closed(timeout=30), f"{len(attack.closed)} of 64 closed"
        finally:
            attack.close()
    finally:
        bs.close()
