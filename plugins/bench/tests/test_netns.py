"""The emulated cluster (`weightsync_bench.netns`) on this machine's kernel: a real TCP transfer
between two host namespaces arrives bit-exact and moves the links' byte counters, tbf is installed
with the asked rate on both ends of every link, and nothing with the cluster's names is left
after it closes, also when the body raised and when a process was still running inside.

Needs root, iproute2 and a kernel with veth and tbf; skipped with the reason otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from weightsync_bench import netns
try:
    netns.probe()
except netns.NetnsUnavailable as e:
    pytest.skip(reason=str(e), allow_module_level=True)

PORT = 9500
SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
conn, _ = srv.accept()
with open(sys.argv[3], "wb") as f:
    while chunk := conn.recv(1 << 20):
        f.write(chunk)
conn.close()
"""
SEND = """
import socket, sys, time
deadline = time.monotonic() + 30
while True:                                   # the sink may not listen yet: retry, bounded
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
s.sendall(open(sys.argv[3], "rb").read())
s.shutdown(socket.SHUT_WR)
assert s.recv(1) == b""                       # the sink closed: it has every byte
"""


def leftovers(tag: str) -> tuple[list[str], list[str]]:
    """Namespaces with the cluster's tag, and links with it in the root namespace."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return netns.namespaces(tag), [ln for ln in links.splitlines() if tag in ln]


def test_transfer_counters_shaping_and_cleanup(tmp_path: Path) -> None:
    payload = os.urandom(6 * 2**20)
    src, dst = tmp_path / "payload", tmp_path / "received"
    src.write_bytes(payload)
    with netns.Cluster(["a", "b"], rate="300mbit") as c:
        tag = c.tag
        assert len(c.names()) == 3 and leftovers(tag)[0] == sorted(c.names())
        for host in ("a", "b"):
            q = c.qdiscs(host)
            for end in ("host", "bridge"):
                assert q[end]["kind"] == "tbf", (host, end, q)
                assert q[end]["options"]["rate"] == 300 * 10**6 // 8, (host, end, q)
        before_a, before_b = c.link_bytes("a"), c.link_bytes("b")
        sink = c.popen("b", [sys.executable, "-c", SINK, c.addr("b"), str(PORT), str(dst)])
        sent = c.run("a", [sys.executable, "-c", SEND, c.addr("b"), str(PORT), str(src)],
                     capture_output=True, text=True, timeout=60)
        assert sent.returncode == 0, sent.stderr
        assert sink.wait(timeout=30) == 0
        assert dst.read_bytes() == payload
        after_a, after_b = c.link_bytes("a"), c.link_bytes("b")
        assert after_a.tx - before_a.tx >= len(payload)
        assert after_b.rx - before_b.rx >= len(payload)
        assert after_b.tx - before_b.tx < len(payload) // 10      # only acks went back
        # the hosts reach each other and nothing else: no route out of the cluster
        routes = c.run("a", ["ip", "-j", "route"], capture_output=True, text=True).stdout
        assert "default" not in routes
    assert leftovers(tag) == ([], [])


def test_cleanup_after_an_exception_kills_what_runs_inside() -> None:
    with pytest.raises(RuntimeError, match="boom"), netns.Cluster(["x"]) as c:
        tag = c.tag
        sleeper = c.popen("x", ["sleep", "600"])
        assert leftovers(tag)[0] == sorted(c.names())
        raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) != 0
    assert leftovers(tag) == ([], [])


# The child installs Python's own Ctrl-C handler: a suite started in the background (CI under a
# non-interactive shell, nohup) hands its processes SIGINT ignored, and they would not see it.
CHILD = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from weightsync_bench.netns import Cluster
with Cluster(["a", "b"]) as c:
    print(c.tag, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signalled_process_cleans_up(sig: signal.Signals) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        tag = child.stdout.readline().strip()          # the cluster is up
        assert tag.startswith(netns.PREFIX) and len(netns.namespaces(tag)) == 3
        child.send_signal(sig)
        child.wait(timeout=30)
    finally:
        child.kill()
    assert leftovers(tag) == ([], [])


def test_stale_namespaces_of_dead_processes_are_swept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}{dead.pid}x0-h"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        mine = f"{netns.PREFIX}{os.getpid()}x999-h"          # a live process's: kept
        subprocess.run(["ip", "netns", "add", mine], check=True)
        try:
            removed = netns.sweep_stale()
            assert stale in removed and mine not in removed
            assert stale not in netns.namespaces() and mine in netns.namespaces()
        finally:
            netns.delete([mine])
    finally:
        netns.delete([stale])
    assert stale not in netns.namespaces()


def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="kbit, mbit or gbit"):
        netns.Cluster(["a"], rate="400mbps")
    with pytest.raises(ValueError, match="lowercase"):
        netns.Cluster(["Trainer"])
    with pytest.raises(ValueError, match="benchmarking range"):
        netns.Cluster(["a"], subnet="10.0.0.0/24")
