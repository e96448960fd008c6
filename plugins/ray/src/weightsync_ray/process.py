"""A child process owned by a Ray actor: it dies with the actor, and the actor dies with it.

Ray restarts an actor whose process dies, not a child the actor started. So the child is bound
both ways: the kernel kills it when the actor's process goes (PR_SET_PDEATHSIG, set by the
thread that then waits on it for its whole life, since the signal follows the forking thread),
and when it exits on its own the actor's process exits too, which Ray sees as a crash and
answers with a restart (`max_restarts`)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Callable

from weightsync.net.process import ServerProcess

__all__ = ["ManagedProcess", "PR_SET_PDEATHSIG", "crash_actor"]

log = logging.getLogger("weightsync_ray")

PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _die_with_parent(libc: ctypes.CDLL | None, parent: int) -> Callable[[], None]:
    """What the child runs before exec: SIGKILL when the forking thread's process is gone (libc
    is loaded by the parent: between fork and exec nothing may take a lock)."""
    def run() -> None:
        if libc is not None and hasattr(libc, "prctl"):
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:    # the parent died before prctl took effect
            os._exit(1)
    return run


def crash_actor(why: str) -> None:
    """Exit this actor's process as a crash, so Ray restarts the actor."""
    log.error("%s; exiting so that Ray restarts this actor", why)
    logging.shutdown()
    os._exit(1)


class ManagedProcess:
    """`argv` run with its output in `log_path`; `on_exit(code)` runs if it ends by itself. The
    start and the stop are core's `ServerProcess`; this adds the two-way binding to the actor."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 on_exit: Callable[[int], None] | None = None) -> None:
        self.argv, self.log_path, self.env = list(argv), Path(log_path), env
        self.on_exit = on_exit
        self.server = ServerProcess("engine", self.log_path)
        self.stopping = False
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.server.proc

    def start(self) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._own, name="ws-ray-child", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self

    def _own(self) -> None:
        """Start the child and wait on it: this thread lives exactly as long as the child."""
        try:
            self.server.launch(self.argv, self.env,
                               preexec_fn=_die_with_parent(_libc(), os.getpid()))
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        assert self.server.proc is not None
        code = self.server.proc.wait()
        if not self.stopping and self.on_exit is not None:
            self.on_exit(code)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def tail(self, lines: int = 15) -> str:
        """The last lines of the child's output (for an error message)."""
        try:
            text = self.log_path.read_bytes()[-8192:].decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL to the child's group, as a crash would: `on_exit` runs (the actor then exits
        and is restarted)."""
        self.server.kill()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the engine deregisters and closes), SIGKILL after `timeout`; no `on_exit`."""
        self.stopping = True
        self.server.stop(timeout)
        if self._thread is not None:
            self._thread.join(5)
