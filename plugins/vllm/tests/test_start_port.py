"""A port the server chose itself and lost before it bound (another process took it between
`free_port()` and the bind, which vLLM does a minute into its start) is replaced by another; a
port the caller gave is never changed. A small HTTP server stands in for vLLM's start here (its
command is the only thing replaced): the retry is the launcher's, not vLLM's."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from weightsync_vllm.launch import VllmServer

SERVE = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
print("starting", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class _Standin(VllmServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", SERVE, str(self.port)]


def _taken() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_chosen_port_taken_before_the_bind_is_replaced(tmp_path: Path) -> None:
    holder = _taken()
    server = _Standin(tmp_path, log=tmp_path / "s.log")
    server.port = lost = holder.getsockname()[1]          # as if another process took it
    try:
        server.start(timeout=60)
        assert server.port != lost and server.url.endswith(f":{server.port}")
        assert "Address already in use" in (tmp_path / "s.log").read_text()
    finally:
        server.stop()
        holder.close()


def test_a_port_the_caller_gave_is_not_changed(tmp_path: Path) -> None:
    holder = _taken()
    port = holder.getsockname()[1]
    server = _Standin(tmp_path, port=port, log=tmp_path / "s.log")
    try:
        with pytest.raises(RuntimeError, match="Address already in use"):
            server.start(timeout=60)
        assert server.port == port
        assert server.tmp is None            # a failed start removed its temporary directory
    finally:
        server.stop()
        holder.close()


WRITES_TMP = """
import sys, tempfile
from pathlib import Path
Path(tempfile.gettempdir(), "vllm_dist_standin").write_text("rendezvous")   # as vLLM leaves it
""" + SERVE


class _TmpWriter(VllmServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", WRITES_TMP, str(self.port)]


def test_what_the_server_leaves_in_its_temporary_directory_goes_with_it(tmp_path: Path) -> None:
    server = _TmpWriter(tmp_path, log=tmp_path / "s.log")
    try:
        server.start(timeout=60)
        assert server.tmp is not None
        own = Path(server.tmp)
        assert (own / "vllm_dist_standin").read_text() == "rendezvous"
    finally:
        server.stop()
    assert not own.exists() and server.tmp is None


WRITES_HEADER = """
from pathlib import Path
from torch._inductor.runtime.cache_dir_utils import default_cache_dir   # where torch puts headers
Path(default_cache_dir(), "precompiled_headers").mkdir(parents=True, exist_ok=True)
Path(default_cache_dir(), "precompiled_headers", "standin.h.gch").write_text("built once")
""" + SERVE


class _HeaderWriter(VllmServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", WRITES_HEADER, str(self.port)]


def test_torchs_inductor_cache_outlives_the_servers_temporary_directory(tmp_path: Path,
                                                                        monkeypatch) -> None:
    """torch builds its precompiled C++ header below the temporary directory (whatever
    $TORCHINDUCTOR_CACHE_DIR says) when vLLM compiles its logprob ranks: in the server's own
    TMPDIR that is a link to the shared cache, so the next server finds the header built."""
    shared = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    server = _HeaderWriter(tmp_path, log=tmp_path / "s.log")
    try:
        server.start(timeout=60)
        own = Path(server.tmp or "")
        assert own.is_dir()
    finally:
        server.stop()
    assert not own.exists()
    assert (shared / "precompiled_headers" / "standin.h.gch").read_text() == "built once"
