"""A fork server for the agent's kill trials: imports the agent and compiles its kernels once,
then runs each trial in a forked child (a real process, cheap to start) and kills it with
SIGKILL from outside at a chosen moment.

Protocol (JSON lines): a request on stdin
    {"root", "local", "log", "target", "fsync", "at", "nth", "delay"}
runs `Agent(root, local).sync_local(target)` in a child. `at` names a step of the agent
(see POINTS; `STEP:after`: once that call returned); when the child enters it for the `nth`
time it tells this server (one byte on a pipe), and the server sends SIGKILL `delay` seconds
later (delay 0: the child waits at that step to be killed there). The reply on stdout:
{"killed": bool, "code": exit code or None}."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from typing import Any, Callable

POINTS = {
    "journal": ("journal", "commit"),               # writing and renaming the journal
    "forward": ("LocalCheckpoint", "_forward"),     # writing a delta in place, checking it
    "write": ("local", "write_changes"),            # any write into the data files
    "undo-record": ("journal", "save_undo"),        # recording the values to put back
    "restore": ("LocalCheckpoint", "_restore"),     # putting them back
    "state": ("local", "atomic_write"),             # moving state.json
    "drop": ("journal", "drop"),                    # dropping the journal
    "replay": ("LocalCheckpoint", "_replay"),       # finishing a journal after a crash
    "build": ("LocalCheckpoint", "build"),          # writing a full version aside
    "build-apply": ("Build", "apply"),              # its deltas
    "commit": ("Build", "commit"),                  # swapping `model` to it
    "none": None,
}


def _arm(at: str, nth: int, tell: int, wait: bool) -> None:
    """Wrap step `at` so its nth call tells the server (and waits to be killed when `wait`);
    `STEP:after` tells once that call has returned (the step done, what follows not begun)."""
    from weightsync_disk_delta import journal, local
    owners: dict[str, Any] = {"journal": journal, "local": local,
                              "LocalCheckpoint": local.LocalCheckpoint, "Build": local.Build}
    after = at.endswith(":after")
    spec = POINTS[at.removesuffix(":after")]
    if spec is None:
        return
    owner, name = owners[spec[0]], spec[1]
    real: Callable[..., Any] = getattr(owner, name)
    calls = [0]

    def reached() -> None:
        os.write(tell, b"!")
        if wait:
            time.sleep(600)                   # killed here

    def step(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        mine = calls[0] == nth
        if mine and not after:
            reached()
        out = real(*args, **kwargs)
        if mine and after:
            reached()
        return out
    setattr(owner, name, step)


def _child(req: dict[str, Any], tell: int) -> int:
    from weightsync.errors import WeightSyncError
    from weightsync_disk_delta.agent import Agent
    _arm(req["at"], req["nth"], tell, wait=req["delay"] == 0)
    with open(req["log"], "a", buffering=1) as log:
        agent = Agent(req["root"], req["local"], fsync=req["fsync"],
                      on_event=lambda m: log.write(f"{m}\n"))
        try:
            log.write(f"done at {agent.sync_local(req['target'])}\n")
            return 0
        except WeightSyncError as e:
            log.write(f"error: {e}\n")
            return 1


def _supervise(pid: int, told: int, delay: float) -> dict[str, Any]:
    """Wait for the child's signal (then kill it after `delay`) or for its exit."""
    killed = False
    while True:
        ready, _, _ = select.select([told], [], [], 0.5)
        if not ready:
            continue
        if os.read(told, 1) != b"!":
            break                                   # the pipe closed: the child exited
        if delay > 0:
            end = time.perf_counter() + delay
            while time.perf_counter() < end:        # sub-millisecond: spin, do not sleep
                pass
        os.kill(pid, signal.SIGKILL)
        killed = True
        break
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return {"killed": killed and code == -signal.SIGKILL, "code": code}


def main() -> None:
    from weightsync_disk_delta import kernels
    from weightsync_disk_delta.agent import Agent  # noqa: F401 - imported once, before forking
    kernels.warm()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        told, tell = os.pipe()
        pid = os.fork()
        if pid == 0:                                # the trial
            os.close(told)
            code = 3
            try:
                code = _child(req, tell)
            finally:
                os._exit(code)
        os.close(tell)
        try:
            reply = _supervise(pid, told, float(req["delay"]))
        finally:
            os.close(told)
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
