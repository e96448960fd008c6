"""Issue 18, the agent and the files of a shared root: a shard or a version directory linked to
somewhere outside the root, a FIFO, a manifest or shard pointing at /dev/zero were accepted (the
FIFO hung the agent holding its lock; /dev/zero grew it to 1.5 GB). Now only regular files below
the root are opened, without following links, and never read past what the manifest allows:
each is refused before a byte of it is read, and the host stays at its whole version."""

from __future__ import annotations

import os
import re
import resource
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from weightsync.errors import PayloadError
from weightsync_disk_delta.agent import Agent
from weightsync_disk_delta.testing import (next_version, publish, raw_manifest, small_model,
                                           version_dir, whole_version, write_manifest)

SHARD = "shard-00000.safetensors"


@pytest.fixture
def hosted(tmp_path: Path) -> dict[str, Any]:
    """Versions 1 (full) and 2 (delta); a host at version 1; a directory outside the root that
    holds exact copies of version 2 (so a link there would pass every checksum)."""
    s1 = small_model()
    states = {1: s1, 2: next_version(s1, 2)}
    root = tmp_path / "root"
    publish(root, states)
    agent = Agent(root, tmp_path / "local")
    assert agent.sync_local(1) == 1
    outside = tmp_path / "outside"
    shutil.copytree(version_dir(root, 2), outside / "v00000002")
    return {"root": root, "states": states, "agent": agent, "outside": outside}


def _refused(h: dict[str, Any], match: str) -> str:
    """sync_local returns (no hang) with a PayloadError matching `match`; the host is whole
    version 1. The guard is for a hang only: the call itself takes milliseconds."""
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["v"] = h["agent"].sync_local()
        except BaseException as e:  # noqa: BLE001 - examined below
            out["e"] = e
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the agent hangs"
    e = out.get("e")
    assert isinstance(e, PayloadError), out
    msg = str(e)
    assert re.search(match, msg), msg
    assert whole_version(h["agent"].local.path, h["states"]) == 1
    return msg


def _replace(path: Path, make: Any) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    make(path)


def test_a_shard_linked_outside_the_root_is_not_read(hosted: dict[str, Any]) -> None:
    shard = version_dir(hosted["root"], 2) / SHARD
    _replace(shard, lambda p: p.symlink_to(hosted["outside"] / "v00000002" / SHARD))
    msg = _refused(hosted, f"{SHARD}.* is a symbolic link")
    assert "nothing behind it was read" in msg or "not read" in msg


def test_a_version_directory_linked_outside_the_root_is_not_read(hosted: dict[str, Any]) -> None:
    d = version_dir(hosted["root"], 2)
    _replace(d, lambda p: p.symlink_to(hosted["outside"] / "v00000002", target_is_directory=True))
    _refused(hosted, "v00000002.* is a symbolic link or not a directory")


def test_the_versions_directory_linked_elsewhere_is_not_read(hosted: dict[str, Any]) -> None:
    root = hosted["root"]
    os.rename(root / "versions", hosted["outside"] / "versions")
    (root / "versions").symlink_to(hosted["outside"] / "versions", target_is_directory=True)
    _refused(hosted, "versions.* is a symbolic link or not a directory")


def test_a_manifest_linked_elsewhere_is_not_read(hosted: dict[str, Any]) -> None:
    p = version_dir(hosted["root"], 2) / "manifest.json"
    _replace(p, lambda q: q.symlink_to(hosted["outside"] / "v00000002" / "manifest.json"))
    _refused(hosted, "manifest.json.* is a symbolic link")


@pytest.mark.parametrize("what", ["shard", "manifest", "latest"])
def test_a_fifo_is_refused_without_blocking(hosted: dict[str, Any], what: str) -> None:
    """The FIFO hung the agent forever while it held the local checkpoint's exclusive lock."""
    p = {"shard": version_dir(hosted["root"], 2) / SHARD,
         "manifest": version_dir(hosted["root"], 2) / "manifest.json",
         "latest": hosted["root"] / "latest"}[what]
    _replace(p, os.mkfifo)
    _refused(hosted, "is a FIFO, not a regular file")
    with hosted["agent"].local.locked():                  # the lock is free again
        pass


@pytest.mark.parametrize("what", ["shard", "manifest"])
def test_dev_zero_is_refused_and_costs_no_memory(hosted: dict[str, Any], what: str) -> None:
    """A shard or manifest that is /dev/zero (through a link, or the device itself where this
    test may create one) is refused before it is read: memory does not grow."""
    p = version_dir(hosted["root"], 2) / (SHARD if what == "shard" else "manifest.json")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _replace(p, lambda q: q.symlink_to("/dev/zero"))
    _refused(hosted, "is a symbolic link")
    try:
        _replace(p, lambda q: os.mknod(q, 0o600 | 0o020000, os.makedev(1, 5)))   # char 1:5 = zero
    except PermissionError:
        pass                        # not root: the link above is the case a user can create
    else:
        _refused(hosted, "is a character device, not a regular file")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 64 * 1024, f"memory grew by {grown} KiB"


def test_latest_linked_elsewhere_is_refused(hosted: dict[str, Any]) -> None:
    (hosted["outside"] / "latest").write_text('{"version": 2, "dir": "versions/v00000002"}')
    _replace(hosted["root"] / "latest", lambda p: p.symlink_to(hosted["outside"] / "latest"))
    with pytest.raises(PayloadError, match="latest.* is a symbolic link"):
        hosted["agent"].sync_local()
    assert whole_version(hosted["agent"].local.path, hosted["states"]) == 1


def test_a_huge_latest_or_manifest_is_not_read(hosted: dict[str, Any]) -> None:
    """`latest` and manifest.json are read only up to a cap (4 KiB, 256 MiB)."""
    with open(hosted["root"] / "latest", "r+b") as f:
        f.truncate(1 << 20)
    with pytest.raises(PayloadError, match="more than the 4096 a file of its kind may hold"):
        hosted["agent"].sync_local()
    hosted["root"].joinpath("latest").write_text('{"version": 2, "dir": "versions/v00000002"}')
    with open(version_dir(hosted["root"], 2) / "manifest.json", "r+b") as f:
        f.truncate(1 << 30)
    _refused(hosted, "more than the 268435456 a file of its kind may hold")


def test_a_shard_name_cannot_leave_its_version(hosted: dict[str, Any]) -> None:
    """Shard file names are checked by the schema (no path), and a listed shard is opened
    relative to its version's directory only."""
    m = raw_manifest(hosted["root"], 2)
    m["shards"][0]["file"] = "../v00000001/shard-00000.safetensors"
    write_manifest(hosted["root"], 2, m)
    _refused(hosted, "shards.0.file: String should match pattern")
