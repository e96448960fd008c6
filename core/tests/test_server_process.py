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


# a server that logs its slow start (a line every 0.1 s for 2 s) before it answers /health
SLOW = textwrap.dedent("""
    import sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    for i in range(20):
        print(f"loading shard {i}", flush=True)
        time.sleep(0.1)
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
        def log_message(self, *a): pass
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_a_start_that_logs_progress_may_take_longer_than_the_stall(tmp_path: Path) -> None:
    port = free_port()
    s = ServerProcess("slow", tmp_path / "slow.log")
    s.launch([sys.executable, "-c", SLOW, str(port)])
    try:
        s.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=60, stall=1.0)
    finally:
        s.stop()
    assert "loading shard 19" in (tmp_path / "slow.log").read_text()


def test_a_start_whose_log_stops_is_stopped_and_its_last_lines_shown(tmp_path: Path) -> None:
    s = ServerProcess("stuck", tmp_path / "stuck.log")
    s.launch([sys.executable, "-c", "import time; print('compiling kernels', flush=True); "
                                    "time.sleep(60)"])
    t = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        s.wait_healthy(f"http://127.0.0.1:{free_port()}/health", timeout=60, stall=1.0)
    assert time.monotonic() - t < 30 and s.proc is not None and s.proc.poll() is not None
    assert "stuck made no progress for 1s (its log did not grow" in str(e.value)
    assert str(e.value).endswith(f"see {tmp_path / 'stuck.log'}; it ends:\n    compiling kernels")
