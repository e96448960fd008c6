"""A server in a child process (the reference engine's `EngineProcess`, vLLM's `VllmServer`):
output to a log, its own session, a bounded start that waits for its health URL, and a stop that
is SIGTERM to its process group, then SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Callable

import requests

__all__ = ["START_STALL_ENV", "START_TIMEOUT_ENV", "ServerProcess", "group_alive", "start_limits"]

START_TIMEOUT_ENV = "WEIGHTSYNC_START_TIMEOUT"   # seconds an engine's start may take in all
START_STALL_ENV = "WEIGHTSYNC_START_STALL"       # seconds its log may stay silent meanwhile


def start_limits(timeout: float, stall: float) -> tuple[float, float]:
    """An engine start's (timeout, stall): the environment's where set, else these defaults."""
    return (float(os.environ.get(START_TIMEOUT_ENV) or timeout),
            float(os.environ.get(START_STALL_ENV) or stall))


class ServerProcess:
    """One child: `launch(argv, env)`, `wait_healthy(url, timeout)`, `stop(grace)`; `kill()` is a
    crash (SIGKILL to the group). A `launch` after a stop restarts it (on the same port)."""

    def __init__(self, name: str, log: Path | None = None) -> None:
        self.name, self.log = name, log
        self.proc: subprocess.Popen | None = None
        self._fh: IO[bytes] | None = None
        self._stopped = True

    def launch(self, argv: list[str], env: dict[str, str] | None = None,
               preexec_fn: Callable[[], None] | None = None,
               spawn: Callable[..., subprocess.Popen] = subprocess.Popen) -> None:
        """Start `argv`; `spawn` is what starts it (Popen's arguments; a test's fork server)."""
        self.stop()                            # a restart: the last run's group and log
        out: int | IO[bytes] = subprocess.DEVNULL
        if self.log is not None:
            self._fh = open(self.log, "ab")     # noqa: SIM115 - open for the child's lifetime
            out = self._fh
        self.proc = spawn(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})}, preexec_fn=preexec_fn,
                          start_new_session=True)
        self._stopped = False

    def _see_log(self, lines: int = 12) -> str:
        """Where the child's log is (kept), and its last lines: what a failed start says."""
        if self.log is None:
            return ""
        try:
            tail = Path(self.log).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            tail = []
        return f"; see {self.log}" + ("; it ends:\n    " + "\n    ".join(tail) if tail else "")

    def _log_size(self) -> int:
        try:
            return Path(self.log).stat().st_size if self.log is not None else 0
        except OSError:
            return 0

    def wait_healthy(self, url: str, timeout: float, verify: bool | str = True,
                     poll: float = 0.1, stall: float | None = None) -> None:
        """Until GET `url` answers 200; an exit, a timeout or a log `stall` stops it, raising."""
        assert self.proc is not None, "launch() first"
        start = moved = time.monotonic()
        size = self._log_size()
        while time.monotonic() < start + timeout:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise RuntimeError(f"{self.name} exited with {code} during start{self._see_log()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(url, timeout=max(1.0, poll * 10), verify=verify).status_code == 200:
                    return
            if stall is not None and self.log is not None:
                now, grown = time.monotonic(), self._log_size()
                if grown != size:
                    size, moved = grown, now
                elif now - moved >= stall:
                    self.stop()
                    raise TimeoutError(f"{self.name} made no progress for {stall:g}s (its log did "
                                       f"not grow; {now - start:.0f}s since start) and did not "
                                       f"answer {url}{self._see_log()}")
            time.sleep(poll)
        self.stop()
        raise TimeoutError(f"{self.name} did not answer {url} within {timeout:g}s{self._see_log()}")

    def _signal(self, sig: signal.Signals) -> bool:
        """`sig` to the child's group while it has members (a reaped group id may be reused)."""
        p = self.proc
        if p is None or (p.poll() is not None and not group_alive(p.pid)):
            return False
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def kill(self) -> None:
        """SIGKILL to the whole group: the server dies wherever it is, as a crashed one would."""
        if self._signal(signal.SIGKILL) and self.proc is not None:
            self.proc.wait()

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the group, SIGKILL after `grace` seconds; the log is closed."""
        p = self.proc
        if p is not None and not self._stopped:
            self._stopped = True
            if self._signal(signal.SIGTERM):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(grace)
                self._signal(signal.SIGKILL)       # workers it forked, too
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def group_alive(pgid: int) -> bool:
    """Whether any process is still in process group `pgid` (Linux: /proc/<pid>/stat)."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if len(fields) > 3 and int(fields[2]) == pgid:
                return True
    return False
