"""Issue 18, the agent's own behaviour on failure: it never moves the host-local checkpoint to an
older version (a bad newest manifest rewound v3 to v1 and reinstalled the full version 19 times
in 15 s), it backs off after a failure and keeps running in loop mode (badly typed fields ended
it), and any exception during an apply is undone, with every worker thread joined first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync.errors import PayloadError
from weightsync_disk_delta import kernels, local as local_mod
from weightsync_disk_delta.agent import Agent, LocalAhead, PlanError
from weightsync_disk_delta.joined import map_joined
from weightsync_disk_delta.local import LocalCheckpoint
from weightsync_disk_delta.testing import (next_version, publish, raw_manifest, rewrite_shard,
                                           shard_arrays, set_shard_arrays, small_model,
                                           version_dir, whole_version, write_manifest)

SHARD = "shard-00000.safetensors"


class Stop(BaseException):
    """Ends a loop the test drives through its `sleep`."""


def _chain(tmp_path: Path, last: int) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    states = {1: small_model()}
    for v in range(2, last + 1):
        states[v] = next_version(states[v - 1], v)
    root = tmp_path / "root"
    publish(root, states)
    return root, states


@pytest.fixture
def at_v3(tmp_path: Path) -> dict[str, Any]:
    """Versions 1..4 published (1 full), a host at version 3, version 4's manifest broken."""
    root, states = _chain(tmp_path, 4)
    events: list[str] = []
    agent = Agent(root, tmp_path / "local", on_event=events.append, max_backoff=60)
    assert agent.sync_local(3) == 3
    good = (version_dir(root, 4) / "manifest.json").read_bytes()
    m = raw_manifest(root, 4)
    m["tensors"]["layers.2.w"]["shape"] = "abc"
    write_manifest(root, 4, m)
    return {"root": root, "states": states, "agent": agent, "events": events, "good": good,
            "seen": len(events)}


def test_a_bad_newest_manifest_never_rewinds_the_host(at_v3: dict[str, Any]) -> None:
    agent, events = at_v3["agent"], at_v3["events"]
    with pytest.raises(PlanError) as ei:
        agent.sync_local()
    msg = str(ei.value)
    assert "version 4: " in msg and "tensors.layers.2.w.shape: Input should be a valid array" in msg
    assert "nothing was applied; the local checkpoint stays at version 3" in msg
    assert whole_version(agent.local.path, at_v3["states"]) == 3
    assert not any("installed full" in e for e in events[at_v3["seen"]:]), events


def test_loop_mode_backs_off_keeps_running_and_never_reinstalls(at_v3: dict[str, Any]) -> None:
    """19 rounds against the bad version: 19 errors, no install, waits doubling up to the cap;
    then the publisher's fix is picked up and the loop reaches version 4."""
    agent, events, root = at_v3["agent"], at_v3["events"], at_v3["root"]
    waits: list[float] = []

    def sleep(s: float) -> None:
        waits.append(s)
        if len(waits) == 19:
            raise Stop()
    with pytest.raises(Stop):
        agent.run(interval=0.5, until=4, sleep=sleep)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0] + [60.0] * 13
    errors = [e for e in events if e.startswith("error (retrying in")]
    assert len(errors) == 19 and all("version 4" in e for e in errors)
    assert not any("installed full" in e for e in events[at_v3["seen"]:])
    assert whole_version(agent.local.path, at_v3["states"]) == 3
    (version_dir(root, 4) / "manifest.json").write_bytes(at_v3["good"])
    waits.clear()
    assert agent.run(interval=0.5, until=4, sleep=sleep) == 4
    assert waits == [] and whole_version(agent.local.path, at_v3["states"]) == 4


def test_loop_mode_survives_an_unexpected_error(at_v3: dict[str, Any],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (version_dir(at_v3["root"], 4) / "manifest.json").write_bytes(at_v3["good"])
    agent = at_v3["agent"]
    real = Agent.sync_local
    calls = []

    def flaky(self: Agent, target: int | None = None) -> int | None:
        calls.append(1)
        if len(calls) == 1:
            raise TypeError("a bug somewhere")
        return real(self, target)
    monkeypatch.setattr(Agent, "sync_local", flaky)
    assert agent.run(interval=0.01, until=4, sleep=lambda s: None) == 4
    assert any("error (retrying in 0.0s): a bug somewhere" in e for e in at_v3["events"])


def test_a_local_checkpoint_newer_than_latest_is_never_moved_back(at_v3: dict[str, Any]) -> None:
    root, agent = at_v3["root"], at_v3["agent"]
    (root / "latest").write_text(json.dumps({"version": 2, "dir": "versions/v00000002"}))
    with pytest.raises(LocalAhead) as ei:
        agent.sync_local()
    msg = str(ei.value)
    assert "holds version 3, newer than version 2" in msg and "never moved back" in msg
    assert f"remove {agent.local.path}" in msg
    assert whole_version(agent.local.path, at_v3["states"]) == 3
    assert agent.sync_local(target=2) == 3                # asking for less is not an error


def test_the_cli_loop_outlives_bad_input(tmp_path: Path) -> None:
    """A real agent process in loop mode on a root whose version 2 is broken keeps running,
    reporting the error with its back-off, and finishes once the publisher fixes it."""
    root, states = _chain(tmp_path, 2)
    good = (version_dir(root, 2) / "manifest.json").read_bytes()
    (version_dir(root, 2) / "manifest.json").write_text('{"format": 7}')
    local = tmp_path / "local"
    Agent(root, local).sync_local(1)
    p = subprocess.Popen([sys.executable, "-m", "weightsync_disk_delta.cli", "agent", "--root",
                          str(root), "--local", str(local), "--engine", "none", "--interval", "0.05",
                          "--max-backoff", "0.2", "--until", "2", "--timeout", "240"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out = ""
        assert p.stdout is not None
        while out.count("error (retrying in") < 3:
            line = p.stdout.readline()
            assert line, out
            out += line
        assert "version 2: " in out and "format: Input should be" in out, out
        (version_dir(root, 2) / "manifest.json").write_bytes(good)
        out += p.stdout.read()
        assert p.wait(timeout=240) == 0, out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "agent: done at version 2" in out
    assert whole_version(local, states) == 2


@pytest.fixture
def at_v1(tmp_path: Path) -> dict[str, Any]:
    root, states = _chain(tmp_path, 2)
    agent = Agent(root, tmp_path / "local")
    assert agent.sync_local(1) == 1
    return {"root": root, "states": states, "agent": agent}


def test_an_exception_while_writing_is_undone_after_every_worker_stopped(
        at_v1: dict[str, Any], kernel_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The third tensor's write fails while the fourth is still being written on the other
    thread: the error surfaces only after the fourth finished (never while a worker writes into
    a mapping that is being undone or unmapped), and every written tensor is put back."""
    real = kernels.swap
    lock = threading.Lock()
    calls: list[int] = []
    finished: list[int] = []
    fourth = threading.Event()

    def swap(region: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, h: Any = None) -> torch.Tensor:
        with lock:
            calls.append(len(calls) + 1)
            n = calls[-1]
        if n == 3:                          # fails once the fourth runs on the other thread
            assert fourth.wait(timeout=60), "the other worker never took the fourth tensor"
            raise RuntimeError("boom")
        if n == 4:
            fourth.set()
            time.sleep(0.3)                                 # still writing when 3 fails
        out = real(region, idx, vals, h)
        finished.append(n)
        return out
    monkeypatch.setattr(kernels, "swap", swap)
    monkeypatch.setenv("WEIGHTSYNC_THREADS", "2")
    with pytest.raises(PayloadError) as ei:
        at_v1["agent"].sync_local()
    msg = str(ei.value)
    assert "writing it failed (RuntimeError: boom); the delta was not applied and the local " \
           "checkpoint stays at version 1" in msg, msg
    # 1, 2 and 4 were written (4 finished before the error surfaced), then the three put back
    # (the undo runs on the same two workers: its three writes finish in any order)
    assert sorted(finished[:3]) == [1, 2, 4] and sorted(finished[3:]) == [5, 6, 7], (calls, finished)
    monkeypatch.setattr(kernels, "swap", real)
    assert whole_version(at_v1["agent"].local.path, at_v1["states"]) == 1
    assert at_v1["agent"].sync_local() == 2


def test_map_joined_joins_every_worker_before_an_interrupt_reaches_the_caller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while two workers write: no further item starts, and KeyboardInterrupt reaches
    the caller only once both running ones have finished."""
    monkeypatch.setenv("WEIGHTSYNC_THREADS", "2")
    seen, second = threading.Event(), threading.Event()
    done: list[int] = []

    def on_sigint(signum: int, frame: Any) -> None:
        seen.set()
        raise KeyboardInterrupt

    def work(i: int) -> int:
        if i == 1:
            second.set()
        if i == 0:                               # once both run: Ctrl-C
            assert second.wait(timeout=60), "the second worker never started"
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        assert seen.wait(timeout=60)             # both still running when the caller sees it
        time.sleep(0.1)
        done.append(i)
        return i
    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        with pytest.raises(KeyboardInterrupt):
            map_joined(work, range(4))
    finally:
        signal.signal(signal.SIGINT, old)
    assert sorted(done) == [0, 1]


def test_map_joined_raises_the_first_error_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_THREADS", "2")
    assert map_joined(lambda i: i * i, range(5)) == [0, 1, 4, 9, 16]

    def work(i: int) -> int:
        if i in (1, 2):
            raise ValueError(f"item {i}")
        return i
    with pytest.raises(ValueError, match="item 1"):
        map_joined(work, range(3))


def _bad_values(root: Path) -> None:
    """Version 2 with one value flipped before its checksum was taken: it passes the shard
    checksum and fails the tensor's digest after it is written."""
    arrays = shard_arrays(root, 2, SHARD)
    arrays["layers.6.w::val"].view(torch.int16)[0] ^= 1
    set_shard_arrays(root, 2, SHARD, arrays)


class Crash(BaseException):
    """Stands for the agent dying at that point."""


def test_a_crash_while_putting_old_values_back_is_finished_by_the_next_open(
        at_v1: dict[str, Any], kernel_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The undo is recorded in the journal before old values go back; a crash while they go
    back leaves new values in the files, and the next open finishes the undo: version 1."""
    _bad_values(at_v1["root"])
    real = local_mod.write_changes
    calls = []

    def write_changes(d: Path, changes: Any, state: Any, replaced: Any, fsync: bool) -> list[str]:
        calls.append(state["version"])
        if len(calls) == 2:                            # the undo: die before writing
            raise Crash()
        return real(d, changes, state, replaced, fsync)
    monkeypatch.setattr(local_mod, "write_changes", write_changes)
    with pytest.raises(Crash):
        at_v1["agent"].sync_local()
    monkeypatch.setattr(local_mod, "write_changes", real)
    d = at_v1["agent"].local.data_dir()
    assert (d / "journal" / "undo.safetensors").is_file() and calls == [2, 1]
    assert LocalCheckpoint(at_v1["agent"].local.path).verify() != []   # mixed until recovered
    assert whole_version(at_v1["agent"].local.path, at_v1["states"]) == 1


def test_a_corrupt_journal_is_discarded_not_a_crash_loop(at_v1: dict[str, Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A journal this process cannot read back (cut short, say) is not trusted: the copy goes
    as a whole, and the next sync installs the newest full version."""
    real = LocalCheckpoint._forward

    def crash(self: LocalCheckpoint, d: Path, j: Any, live: bool) -> None:
        raise Crash()
    monkeypatch.setattr(LocalCheckpoint, "_forward", crash)
    with pytest.raises(Crash):
        at_v1["agent"].sync_local()
    monkeypatch.setattr(LocalCheckpoint, "_forward", real)
    j = at_v1["agent"].local.data_dir() / "journal" / "changes.safetensors"
    j.write_bytes(j.read_bytes()[:100])
    assert whole_version(at_v1["agent"].local.path, at_v1["states"]) is None
    assert at_v1["agent"].sync_local() == 2
    assert whole_version(at_v1["agent"].local.path, at_v1["states"]) == 2


def test_a_digest_mismatch_is_undone_on_every_kernel_path(at_v1: dict[str, Any], kernel_path: str) -> None:
    _bad_values(at_v1["root"])
    with pytest.raises(PayloadError, match="tensors \\['layers.6.w'\\] do not match their digests "
                                           "after the delta was written; the delta was not applied"):
        at_v1["agent"].sync_local()
    assert whole_version(at_v1["agent"].local.path, at_v1["states"]) == 1


def test_a_bad_delta_after_a_full_version_is_never_half_installed(tmp_path: Path) -> None:
    """A new host builds the full version and its chain aside; a delta in that chain that fails
    its digest discards the build, and the host keeps what it had (here: nothing)."""
    root, states = _chain(tmp_path, 2)
    _bad_values(root)
    agent = Agent(root, tmp_path / "new")
    with pytest.raises(PayloadError, match="do not match their digests"):
        agent.sync_local()
    assert whole_version(agent.local.path, states) is None
    assert sorted(p.name for p in agent.local.path.iterdir()) == [".lock"]
    rewrite_shard(root, 2, SHARD, (version_dir(root, 2) / SHARD).read_bytes())
