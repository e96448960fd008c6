"""The side that starts processes: `serving()` runs a fork server for this process and the ones
it starts, `popen` is `subprocess.Popen` that hands what the fork server can run to it, and
`ForkedProcess` is a forked start's handle (a Popen whose exit status the fork server reports)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from weightsync_reference.forkserver.server import HEADER

__all__ = ["ENV", "ForkedProcess", "popen", "serving"]

ENV = "WEIGHTSYNC_FORKSERVER"       # the socket of the fork server that takes this process's starts
# the Popen arguments a forked start honours; any other sends the start to subprocess.Popen
TAKEN = {"stdin", "stdout", "stderr", "env", "cwd", "preexec_fn", "start_new_session"}
STREAMS = ("stdin", "stdout", "stderr")


class ForkedProcess(subprocess.Popen):
    """A start that the fork server forked: `pid`, `poll`, `wait`, `send_signal`, `kill` and
    `terminate` as on a Popen. The fork server is the child's parent, so its exit status comes
    as a line on this start's connection. No pipes: the streams were files or /dev/null."""

    def __init__(self, args: list[str], sock: socket.socket, pid: int, buffered: bytes) -> None:
        # not Popen.__init__: this process did not start the child
        self.args, self.pid, self.returncode = args, pid, None
        self.stdin = self.stdout = self.stderr = None
        self._child_created = False                 # what Popen.__del__ looks at
        self._sock, self._buf = sock, buffered

    def _take(self, timeout: float | None) -> None:
        """The exit status, if it comes within `timeout` seconds (0: only what has come)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None and b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(4096)
            except (TimeoutError, BlockingIOError):
                return
            if not chunk:                            # the fork server is gone: init reaps it
                self._orphaned(deadline)
                return
            self._buf += chunk
        if self.returncode is None:
            self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["returncode"])
            self._sock.close()

    def _orphaned(self, deadline: float | None) -> None:
        """The fork server died first: the child ends when /proc no longer lists it (status
        unknown: 255)."""
        while os.path.exists(f"/proc/{self.pid}"):
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(0.05)
        self.returncode = 255
        self._sock.close()

    def poll(self) -> int | None:
        self._take(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._take(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._sock.close()


def _fds(kw: dict[str, Any], stack: contextlib.ExitStack) -> list[int]:
    """The three standard streams as file descriptors (ValueError: a pipe, which a fork server's
    child cannot hand back)."""
    fds: list[int] = []
    for i, key in enumerate(STREAMS):
        value = kw.get(key)
        if value is None:
            fds.append(i)                           # inherited, as Popen does
        elif value == subprocess.DEVNULL:
            fds.append(stack.enter_context(open(os.devnull, "r+b")).fileno())
        elif value == subprocess.STDOUT and key == "stderr":
            fds.append(fds[1])
        elif isinstance(value, int) and value >= 0:
            fds.append(value)
        elif hasattr(value, "fileno"):
            fds.append(value.fileno())
        else:
            raise ValueError(f"{key}={value!r} needs a fresh process")
    return fds


def _request(path: str, args: list[str], kw: dict[str, Any]) -> ForkedProcess | None:
    """Ask the fork server at `path` to start `args`; None when it declines."""
    env = dict(os.environ if kw.get("env") is None else kw["env"])
    cwd = os.fspath(kw.get("cwd") or os.getcwd())
    body = json.dumps({"argv": args, "env": env, "cwd": cwd}).encode()
    message = HEADER.pack(len(body)) + body
    with contextlib.ExitStack() as stack:
        fds = _fds(kw, stack)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(30)
            sock.connect(path)
            sent = socket.send_fds(sock, [message], fds)
            sock.sendall(message[sent:])
            buf = b""
            while b"\n" not in buf:
                chunk = sock.recv(4096)
                if not chunk:
                    raise ConnectionError("the fork server closed the connection")
                buf += chunk
        except BaseException:
            sock.close()
            raise
    line, rest = buf.split(b"\n", 1)
    answer = json.loads(line)
    if "pid" not in answer:
        sock.close()
        return None
    return ForkedProcess(args, sock, int(answer["pid"]), rest)


def popen(args: list[str], **kw: Any) -> subprocess.Popen:
    """`subprocess.Popen(args, **kw)`, forked by the fork server that WEIGHTSYNC_FORKSERVER names
    when there is one and it can run the start as a fresh interpreter would (a new session, no
    preexec_fn, no pipes); otherwise a fresh process as before."""
    path = os.environ.get(ENV)
    if path and kw.get("start_new_session") and kw.get("preexec_fn") is None and set(kw) <= TAKEN:
        with contextlib.suppress(OSError, ValueError, KeyError):   # none there, or it declined
            forked = _request(path, list(args), kw)
            if forked is not None:
                return forked
    return subprocess.Popen(args, **kw)


@contextlib.contextmanager
def serving(timeout: float = 120.0, wait: bool = True) -> Iterator[str | None]:
    """A fork server for this process and the processes it starts: WEIGHTSYNC_FORKSERVER names its
    socket while the block runs. Yields the socket's path, or None when the fork server did not
    come up within `timeout` (starts then take fresh processes, as without one). `wait=False`
    yields the path at once, while the fork server still imports: starts before it listens take
    fresh processes (a test session does not wait about 10 s of CPU for it)."""
    tmp = tempfile.mkdtemp(prefix="weightsync-fork-")
    path = os.path.join(tmp, "socket")
    with open(os.path.join(tmp, "forkserver.log"), "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "weightsync_reference.forkserver", path],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    before = os.environ.get(ENV)
    try:
        deadline = time.monotonic() + timeout
        up = not wait
        while not up and proc.poll() is None and time.monotonic() < deadline:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                up = probe.connect_ex(path) == 0
            if not up:
                time.sleep(0.05)
        if up:
            os.environ[ENV] = path
        yield path if up else None
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
