"""The one server-process starter (weightsync.net.process): real child processes, a real health
URL, real signals."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from weightsync.net.process import ServerProcess, group_alive
from weightsync.net.server import free_port

# a server that forks a worker (as vLLM forks its engine core) and answers /health
SERVER = textwrap.dedent("""
    import os, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    worker = os.fork()
    if worker == 0:
        while True:
            time.sleep(1)
    open(sys.argv[2], "w").write(str(worker))
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
        def log_message(self, *a): pass
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_start_until_healthy_then_stop_reaches_the_workers_it_forked(tmp_path: Path) -> None:
    port, pidfile = free_port(), tmp_path / "worker.pid"
    s = ServerProcess("toy", tmp_path / "toy.log")
    s.launch([sys.executable, "-c", SERVER, str(port), str(pidfile)])
    s.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=30)
    assert s.proc is not None
    worker = int(pidfile.read_text())
    assert _alive(worker) and group_alive(s.proc.pid)
    s.stop(grace=5)
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "the forked worker outlived the server"
    s.stop()                                  # a second stop signals nothing (the pid may be reused)


def test_a_child_that_exits_during_start_is_reported_with_its_log(tmp_path: Path) -> None:
    s = ServerProcess("broken", tmp_path / "broken.log")
    s.launch([sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"])
    with pytest.raises(RuntimeError, match=r"broken exited with 3 during start; see .*broken\.log"):
        s.wait_healthy(f"http://127.0.0.1:{free_port()}/health", timeout=30)
    assert "bad flag" in (tmp_path / "broken.log").read_text()


def test_a_child_that_never_answers_is_stopped_at_the_timeout(tmp_path: Path) -> None:
    s = ServerProcess("silent")
    s.launch([sys.executable, "-c", "import time; time.sleep(60)"])
    assert s.proc is not None
    with pytest.raises(TimeoutError, match="silent did not answer .* within 1s"):
        s.wait_healthy(f"http://127.0.0.1:{free_port()}/health", timeout=1)
    assert s.proc.poll() is not None and os.getpgid(os.getpid()) != s.proc.pid
