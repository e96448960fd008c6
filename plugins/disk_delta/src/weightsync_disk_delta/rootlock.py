"""The lock of a published root: one publisher at a time. Two trainers publishing into one root
would delete each other's temporary directories and race for `latest`; the second one is refused
with the first one's host and pid instead. The lock is an flock on ROOT/.publisher.lock (over
NFS, Linux maps it to a lock the server holds for every client), held from the first publish
until the transport is closed, and released by the kernel when the process dies."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

LOCK_NAME = ".publisher.lock"


class LockHeld(Exception):
    """Another publisher holds the root; the message names it."""


class PublisherLock:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._file: IO[bytes] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock (no wait); LockHeld when another publisher has it, OSError when the
        root cannot be written."""
        if self._file is not None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK_NAME
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        f = open(path, "rb")       # noqa: SIM115 - held until release(); read-only, so the
        try:                       # filesystem can still be remounted read-only under it
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(f)
            f.close()
            raise LockHeld(self._held_message(holder)) from None
        except BaseException:
            f.close()
            raise
        try:
            with open(path, "r+b") as w:                  # who holds it, for the next one's error
                w.truncate()
                w.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                    "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
        except BaseException:
            f.close()
            raise
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            finally:
                self._file.close()
                self._file = None

    def _held_message(self, holder: dict[str, Any]) -> str:
        who = (f"process {holder.get('pid')} on host {holder.get('host')} (since "
               f"{holder.get('since')})" if holder else "another process")
        same = holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()
        hint = ("this process already publishes there through another WeightSync or transport; "
                "close that one first" if same else
                "only one trainer may publish into a root: stop the other one, or give this one "
                "another `root`")
        return f"{self.root} is locked by another publisher, {who}; {hint}"


def _holder(f: IO[bytes]) -> dict[str, Any]:
    try:
        f.seek(0)
        body = json.loads(f.read(4096) or b"{}")
        return body if isinstance(body, dict) else {}
    except (OSError, ValueError):
        return {}
