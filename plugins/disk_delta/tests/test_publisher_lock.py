"""Issue 18, two publishers on one root: one's `open()` deleted the other's temporary directory,
the error named the wrong `latest`, and `.trash-*` directories were never removed. Now the root
has one publisher at a time (an flock, refused with the holder's host and pid), temporary names
carry host and pid, errors read `latest` again, and leftovers are swept under the lock."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from weightsync import WeightSync
from weightsync.errors import TransportError
from weightsync.interfaces import Payload
from weightsync.wire.frame import pack
from weightsync_disk_delta import transport as transport_mod
from weightsync_disk_delta.layout import list_versions, read_latest
from weightsync_disk_delta.testing import next_version, publish, publish_config, small_model
from weightsync_disk_delta.transport import DiskDeltaTransport


def _transport(root: Path) -> DiskDeltaTransport:
    return DiskDeltaTransport(DiskDeltaTransport.Options(root=str(root), fsync=False))


def test_a_second_publisher_is_refused_and_the_first_keeps_its_temporary_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    s1 = small_model()
    a = WeightSync.from_config(publish_config(root))
    try:
        assert a.push(s1, version=1).ok
        first = _transport(root)                  # another publisher in this process
        with pytest.raises(TransportError) as ei:
            first.open([], 2)
        msg = str(ei.value)
        assert f"is locked by another publisher, process {os.getpid()} on host " \
               f"{socket.gethostname()}" in msg and "close that one first" in msg, msg
        assert "version 2 was not published" in msg
        s2 = next_version(s1, 2)
        assert a.push(s2, version=2).ok            # the holder goes on undisturbed
    finally:
        a.close()
    assert read_latest(root) == 2
    b = _transport(root)                          # released on close: the next one may publish
    b.open([], 3)
    assert b._tmp is not None and b._tmp.is_dir()
    c = _transport(root)
    with pytest.raises(TransportError, match="is locked by another publisher"):
        c.open([], 3)
    assert b._tmp.is_dir()                        # the holder's temporary directory survives
    b.close()
    assert not [p for p in (root / "versions").iterdir() if p.name.startswith(".tmp-")]


def test_a_publisher_in_another_process_is_named(tmp_path: Path) -> None:
    root = tmp_path / "root"
    publish(root, {1: small_model()})
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, json, os, sys, time\n"
         f"f = open({str(root / '.publisher.lock')!r}, 'rb')\n"
         "fcntl.flock(f, fcntl.LOCK_EX)\n"
         f"w = open({str(root / '.publisher.lock')!r}, 'r+b')\n"
         "w.truncate()\n"
         "w.write(json.dumps({'host': 'trainer-7', 'pid': os.getpid(), 'since': 'then'}).encode())\n"
         "w.close()\n"
         "print('held', flush=True)\nsys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        t = _transport(root)
        with pytest.raises(TransportError) as ei:
            t.open([], 2)
        msg = str(ei.value)
        assert f"process {holder.pid} on host trainer-7 (since then)" in msg, msg
        assert "only one trainer may publish into a root" in msg
        assert list_versions(root) == [1] and read_latest(root) == 1
        assert not [p for p in (root / "versions").iterdir() if p.name.startswith(".")]
    finally:
        holder.communicate("", timeout=60)
    t.open([], 2)                                # the holder exited: the kernel released it
    t.close()


def test_the_error_names_what_latest_points_at_now(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure reads `latest` again for its message: here something moved it (a writer that
    ignores the lock) after this publisher opened version 2."""
    root = tmp_path / "root"
    publish(root, {1: small_model()})
    t = _transport(root)
    t.open([], 2)
    (root / "latest").write_text(json.dumps({"version": 1, "dir": "versions/v00000001"}))
    os.rename(root / "versions" / "v00000001", root / "versions" / "v00000005")
    (root / "latest").write_text(json.dumps({"version": 5, "dir": "versions/v00000005"}))

    def full(path: Path, data: object, fsync: bool = True) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(transport_mod, "write_file", full)
    body = pack([])                                     # an empty raw payload
    with pytest.raises(TransportError) as ei:
        t.send(Payload(0, True, "raw", "", [], body, {}), [])
    msg = str(ei.value)
    assert "`latest` still points at version 5" in msg and "free space" in msg, msg
    t.close()


def test_temporary_names_differ_across_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = []
    for host in ("rack1-node3", "rack2-node3"):
        monkeypatch.setattr(socket, "gethostname", lambda h=host: h)
        root = tmp_path / host
        t = _transport(root)
        t.open([], 1)
        assert t._tmp is not None
        names.append(t._tmp.name)
        t.close()
    assert names[0] != names[1]
    for host, name in zip(("rack1-node3", "rack2-node3"), names):
        assert name.startswith(f".tmp-v00000001-{host}-{os.getpid()}-"), name


def test_leftovers_of_crashed_publishers_are_swept(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`.tmp-*` of a crashed publish and `.trash-*` of a retirement that could not finish are
    removed by the next publish (under the lock: no live publisher owns them)."""
    root = tmp_path / "root"
    s = {1: small_model()}
    for v in range(2, 5):
        s[v] = next_version(s[v - 1], v)
    publish(root, {1: s[1]})
    versions = root / "versions"
    (versions / ".tmp-v00000009-otherhost-123-abcd").mkdir()
    (versions / ".trash-v00000000-otherhost-123-abcd" / "x").mkdir(parents=True)
    calls = []
    real = transport_mod.shutil.rmtree

    def flaky(path: object, ignore_errors: bool = False) -> None:
        calls.append(str(path))
        if ".trash-v00000001" in str(path) and len([c for c in calls if ".trash-v00000001" in c]) == 1:
            return                                    # the retirement's delete fails once
        real(path, ignore_errors=ignore_errors)
    monkeypatch.setattr(transport_mod.shutil, "rmtree", flaky)
    with WeightSync.from_config(publish_config(root)) as sync:   # a new trainer: 2 is full
        assert sync.push(s[2], version=2).ok          # 1 retires; its first delete fails
        left = sorted(p.name for p in versions.iterdir() if p.name.startswith("."))
        assert left == [], left                      # swept at the end of the retirement
        assert list_versions(root) == [2]
        assert sync.push(s[3], version=3).ok
        (versions / ".trash-v00000002-crashed-1-ffff").mkdir()
        assert sync.push(s[4], version=4).ok
    assert not [p for p in versions.iterdir() if p.name.startswith(".")]
    assert any(".trash-v00000001" in c for c in calls)
