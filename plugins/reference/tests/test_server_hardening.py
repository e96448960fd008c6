"""Hostile or broken input against weightsync's HTTP services (the reference engine here; the
fleet registry and the peer routes share the same server): the key is checked before any body
is read, bodies are capped per route, slow and idle connections time out, connections are
capped, any bad header is a 4xx, and load_from_disk reads only below its roots."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests
from safetensors.torch import save_file

from weightsync.net.keys import resolve_key, warn_if_open
from weightsync.plugins import load_components
from weightsync_reference.server.app import make_server
from weightsync_reference.server.engine import ReferenceEngine
from weightsync_reference.server.model import load_model
from weightsync.testing import sample_state_dict, write_weights_only_model

KEY = "engine-key-0123456789"


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, ReferenceEngine, Path]]:
    model = write_weights_only_model(tmp_path / "m", sample_state_dict())
    engine = ReferenceEngine(load_model(model), load_components(), "hardened")
    root = tmp_path / "allowed"
    root.mkdir()
    server = make_server(engine, "127.0.0.1", 0, KEY, [str(root)], max_connections=6)
    for h in (server.RequestHandlerClass,):
        h.timeout = 1.0                       # header / idle timeout, short for the test
        h.body_timeout = 1.0
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", engine, root
    server.shutdown()
    server.server_close()
    engine.close()


def _raw(url: str, data: bytes, read: bool = True, timeout: float = 5.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out and b"Content-Length" in out:
                head, _, body = out.partition(b"\r\n\r\n")
                n = int(head.split(b"Content-Length:")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    break
        return out


def test_the_key_is_checked_before_any_body_is_read(served) -> None:  # noqa: ANN001
    url, _, _ = served
    before = _rss()
    answers = []
    for _ in range(3):                     # each claims 300 MB and sends nothing
        answers.append(_raw(url, b"POST /weightsync/payload HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Length: 300000000\r\n\r\n"))
    assert all(a.startswith(b"HTTP/1.1 401") for a in answers), answers[0][:200]
    assert b"missing or wrong API key" in answers[0]
    assert _rss() - before < 50 * 2**20
    r = requests.post(url + "/weightsync/begin", json={}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401


def test_bodies_are_capped_per_route(served) -> None:  # noqa: ANN001
    url, engine, _ = served
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    a = _raw(url, b"POST /pause HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 5000000\r\n\r\n")
    assert a.startswith(b"HTTP/1.1 413") and b"over this route's limit" in a
    r = requests.post(url + "/weightsync/begin", headers={"Authorization": f"Bearer {KEY}"},
                      json={"version": 1, "transport": {"kind": "http"}, "encoding": {"kind": "raw"}})
    rid = r.json()["round"]
    huge = 10 * 2**30
    a = _raw(url, b"POST /weightsync/payload HTTP/1.1\r\nHost: x\r\n" + auth
             + f"X-Weightsync-Round: {rid}\r\nContent-Length: {huge}\r\n\r\n".encode())
    assert a.startswith(b"HTTP/1.1 413")
    engine.abort(rid)


def test_bad_headers_are_4xx_never_500(served) -> None:  # noqa: ANN001
    url, _, _ = served
    a = _raw(url, "GET /info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ключ\r\n\r\n".encode())
    assert a.startswith(b"HTTP/1.1 401")
    a = _raw(url, b"POST /pause HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
             + b"\r\nContent-Length: abc\r\n\r\n")
    assert a.startswith(b"HTTP/1.1 400") and b"not a number" in a
    a = _raw(url, b"POST /pause HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
             + b"\r\nContent-Length: -5\r\n\r\n")
    assert a.startswith(b"HTTP/1.1 400")
    a = _raw(url, b"GARBAGE\r\n\r\n")
    assert a.startswith(b"HTTP/1.1 4")
    a = _raw(url, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n")
    assert a.startswith(b"HTTP/1.1 414") or a.startswith(b"HTTP/1.1 400")
    r = requests.post(url + "/generate", data=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    r = requests.post(url + "/weightsync/begin", json={"version": "x"},
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400


def test_slow_and_idle_connections_time_out(served) -> None:  # noqa: ANN001
    url, _, _ = served
    host, port = url.removeprefix("http://").split(":")
    socks = []
    t0 = time.monotonic()
    for _ in range(3):                      # never finish their headers
        s = socket.create_connection((host, int(port)))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    for s in socks:
        s.settimeout(10)
        got = s.recv(100)                    # the server drops them after its header timeout
        assert got == b"" or got.startswith(b"HTTP/1.1 4"), got
    assert time.monotonic() - t0 < 8
    for s in socks:
        s.close()
    assert requests.get(url + "/health", timeout=5).status_code == 200


def test_slow_heads_cannot_shut_out_new_clients(served) -> None:  # noqa: ANN001
    """Unfinished heads from clients that showed no key hold no slot a new client needs: the
    oldest is closed to make room (the connection cap itself: tests/test_slow_clients.py)."""
    url, _, _ = served
    host, port = url.removeprefix("http://").split(":")
    hold = []
    for _ in range(6):                      # as many unfinished heads as the service reads at once
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")   # headers unfinished
        hold.append(s)
    a = _raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert a.startswith(b"HTTP/1.1 200")
    assert hold[0].recv(1) == b""           # the oldest slow head was closed for it
    for s in hold:
        s.close()
    assert requests.get(url + "/health", timeout=5).status_code == 200


def test_load_from_disk_reads_only_below_its_roots(served, tmp_path: Path) -> None:  # noqa: ANN001
    url, engine, root = served
    h = {"Authorization": f"Bearer {KEY}"}
    sd = sample_state_dict()
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(outside / "model.safetensors"))
    r = requests.post(url + "/weightsync/load_from_disk", json={"path": str(outside), "version": 1}, headers=h)
    assert r.status_code == 403 and "not below a directory" in r.json()["error"]
    link = root / "sneaky"
    link.symlink_to(outside)                # a link out of the root is outside, too
    r = requests.post(url + "/weightsync/load_from_disk", json={"path": str(link), "version": 1}, headers=h)
    assert r.status_code == 403
    r = requests.post(url + "/weightsync/load_from_disk",
                      json={"path": str(root / ".." / "outside"), "version": 1}, headers=h)
    assert r.status_code == 403
    inside = root / "v1"
    inside.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(inside / "model.safetensors"))
    r = requests.post(url + "/weightsync/load_from_disk", json={"path": str(inside), "version": 1}, headers=h)
    assert r.status_code == 200 and engine.version == 1


def test_keys_come_from_a_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "key"
    f.write_text("from-a-file\n")
    assert resolve_key(None, str(f)) == "from-a-file"
    monkeypatch.setenv("WEIGHTSYNC_API_KEY", "from-env")
    assert resolve_key(None, None) == "from-env" and resolve_key("arg", str(f)) == "arg"
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        resolve_key(None, str(empty))
    warn_if_open("0.0.0.0", None, "the reference engine x")
    assert "WARNING" in capsys.readouterr().out
    warn_if_open("127.0.0.1", None, "the reference engine x")
    warn_if_open("0.0.0.0", "k", "the reference engine x")
    assert capsys.readouterr().out == ""
