"""The published layout: manifests, the atomic `latest`, full versions, retention, hooks, and
failures (unwritable root, full disk, flipped byte) that leave the previous version current."""

from __future__ import annotations

import json
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from weightsync import WeightSync
from weightsync.wire.bucket import digest_tensors
from weightsync.errors import PayloadError, TransportError
from weightsync_disk_delta import testing
from weightsync_disk_delta.agent import Agent
from weightsync_disk_delta.layout import list_versions, read_latest, read_manifest
from weightsync_disk_delta.testing import Trainer, bit_equal, publish_config, raw_manifest


def _publish(tr: Trainer, sync: WeightSync, versions: range, states: dict) -> None:
    for v in versions:
        tr.step()
        states[v] = tr.state()
        r = sync.push(states[v], version=v)
        assert r.ok and r.version == v


def test_layout_manifest_and_latest(tmp_path: Path, trainer: Trainer) -> None:
    root = tmp_path / "root"
    states: dict = {}
    cfg = publish_config(root)
    cfg["transport"]["options"]["after_write"] = "weightsync_disk_delta.testing:record_hook"
    testing.HOOK_CALLS.clear()
    with WeightSync.from_config(cfg) as sync:
        _publish(trainer, sync, range(1, 5), states)
        assert sync.last_version == 4
    assert read_latest(root) == 4
    assert json.loads((root / "latest").read_text()) == {"version": 4, "dir": "versions/v00000004"}
    assert list_versions(root) == [1, 2, 3, 4]
    assert not [p for p in (root / "versions").iterdir() if p.name.startswith(".")]   # no temp names
    kinds = {}
    for v in range(1, 5):
        assert read_manifest(root, v).version == v          # valid against the schema
        m = raw_manifest(root, v)
        kinds[v] = m["kind"]
        assert m["encoding"] == "delta" and m["version"] == v
        assert m["base_version"] == (None if v == 1 else v - 1)
        assert {s["file"] for s in m["shards"]} == {t["shard"] for t in m["tensors"].values()}
        for name, t in m["tensors"].items():
            ref = states[v][name]
            assert t["digest"] == digest_tensors([(name, ref)])
            assert t["dtype"] == "bfloat16" and t["shape"] == list(ref.shape)
    assert kinds == {1: "full", 2: "delta", 3: "delta", 4: "delta"}
    full = raw_manifest(root, 1)["wire_bytes"]
    assert all(raw_manifest(root, v)["wire_bytes"] < full / 3 for v in (2, 3, 4))
    assert str(root / "latest") in testing.HOOK_CALLS and str(root / "versions" / "v00000004") in testing.HOOK_CALLS


def test_full_every_and_retention(tmp_path: Path, trainer: Trainer) -> None:
    root = tmp_path / "root"
    states: dict = {}
    with WeightSync.from_config(publish_config(root, full_every=3)) as sync:
        _publish(trainer, sync, range(1, 9), states)
    # full versions 1, 4, 7; keep_full=1 keeps the newest full one and its chain only
    assert list_versions(root) == [7, 8]
    assert raw_manifest(root, 7)["kind"] == "full" and raw_manifest(root, 8)["kind"] == "delta"
    agent = Agent(root, tmp_path / "late")          # a late joiner: newest full + its chain
    assert agent.sync_local() == 8
    assert bit_equal(agent.local.tensors(), states[8]) == []


def test_full_when_the_chain_outweighs_one(tmp_path: Path, trainer: Trainer) -> None:
    root = tmp_path / "root"
    cfg = publish_config(root, full_when_chain_exceeds=1e-6)
    cfg["transport"]["options"]["keep_full"] = 10
    with WeightSync.from_config(cfg) as sync:
        _publish(trainer, sync, range(1, 6), {})
    assert [raw_manifest(root, v)["kind"] for v in range(1, 6)] == ["full", "delta", "full", "delta", "full"]


def test_a_delta_into_a_root_without_a_full_version_is_refused(tmp_path: Path, trainer: Trainer) -> None:
    root = tmp_path / "root"
    with WeightSync.from_config(publish_config(root, base_checkpoint=str(tmp_path / "model"))) as sync:
        trainer.step()
        with pytest.raises(TransportError, match="holds no full version"):
            sync.push(trainer.state(), version=1)
    assert read_latest(root) is None and list_versions(root) == []


def test_gap_in_the_chain_falls_back_to_the_newest_full(tmp_path: Path, trainer: Trainer) -> None:
    root = tmp_path / "root"
    states: dict = {}
    cfg = publish_config(root, full_every=3)
    cfg["transport"]["options"]["keep_full"] = 5
    events: list[str] = []
    agent = Agent(root, tmp_path / "local", on_event=events.append)
    with WeightSync.from_config(cfg) as sync:
        _publish(trainer, sync, range(1, 3), states)
        assert agent.sync_local() == 2
        _publish(trainer, sync, range(3, 6), states)
    import shutil
    shutil.rmtree(root / "versions" / "v00000003")    # a gap: 3 is missing, 4 is full
    assert agent.sync_local() == 5
    assert bit_equal(agent.local.tensors(), states[5]) == []
    assert any("installed full version 4" in e for e in events)


def test_a_version_of_only_whole_tensors_is_a_full_one_and_installed_fresh(tmp_path: Path) -> None:
    """Dense changes ship every tensor whole: that version is published as a full one, and the
    host makes a fresh copy and swaps it in instead of journalling the whole model in place."""
    import torch
    root = tmp_path / "root"
    g = torch.Generator().manual_seed(0)
    states = {v: {f"w{i}": torch.randn(64, 96, generator=g).to(torch.bfloat16) for i in range(3)}
              for v in range(1, 4)}
    states[3]["w1"] = states[2]["w1"].clone()           # version 3 leaves one tensor as it was
    events: list[str] = []
    agent = Agent(root, tmp_path / "local", on_event=events.append)
    with WeightSync.from_config(publish_config(root)) as sync:
        sync.push(states[1], version=1)
        assert agent.sync_local() == 1
        first_dir = agent.local.data_dir()
        sync.push(states[2], version=2)
        m = raw_manifest(root, 2)
        assert m["kind"] == "full" and {t["kind"] for t in m["tensors"].values()} == {"full"}
        assert agent.sync_local() == 2
        assert any("installed full version 2" in e for e in events)
        assert agent.local.data_dir() != first_dir and first_dir is not None and not first_dir.exists()
        assert bit_equal(agent.local.tensors(), states[2]) == []
        sync.push(states[3], version=3)                  # not all whole: applied in place
        assert agent.sync_local() == 3
        assert any("applied delta version 3" in e for e in events)
        assert bit_equal(agent.local.tensors(), states[3]) == [] and agent.local.verify() == []


def _sparse_array(root: Path, version: int, part: str) -> tuple[Path, int]:
    """(shard path, absolute offset) of the `part` ("pos" or "val") array of the first tensor
    the version ships as a sparse delta with changes."""
    from weightsync_disk_delta.local import tensor_offsets
    m = raw_manifest(root, version)
    name, t = next((n, t) for n, t in m["tensors"].items() if t["kind"] == "sparse" and t["changed"] > 8)
    shard = root / "versions" / f"v{version:08d}" / t["shard"]
    suffix = t["pos"] if part == "pos" else part
    return shard, tensor_offsets(shard)[f"{name}::{suffix}"]["offset"]


@pytest.mark.parametrize("where", ["shard", "values+checksum", "positions+checksum"])
def test_flipped_byte_is_detected_and_never_applied(tmp_path: Path, trainer: Trainer, where: str) -> None:
    """A flipped byte in a shard fails the shard's checksum before anything is written. One that
    was flipped before the checksum was taken (`+checksum`) fails a tensor digest on the written
    bytes: the local data is discarded before the version becomes current, and the newest full
    version is installed again. Either way the local checkpoint stays at version 1."""
    root = tmp_path / "root"
    states: dict = {}
    events: list[str] = []
    agent = Agent(root, tmp_path / "local", before_read=testing.record_hook, on_event=events.append)
    with WeightSync.from_config(publish_config(root)) as sync:
        _publish(trainer, sync, range(1, 2), states)
        assert agent.sync_local() == 1
        _publish(trainer, sync, range(2, 3), states)
    shard, off = _sparse_array(root, 2, "pos" if where.startswith("positions") else "val")
    good = shard.read_bytes()
    data = bytearray(good)
    data[off + 2] ^= 0x01                              # a low bit: positions stay in range
    shard.write_bytes(bytes(data))
    if where != "shard":                               # corrupted before it was hashed
        from weightsync_disk_delta.layout import file_digest
        m = raw_manifest(root, 2)
        for s in m["shards"]:
            if s["file"] == shard.name:
                s["xxh3"] = file_digest(bytes(data))
        (root / "versions" / "v00000002" / "manifest.json").write_text(json.dumps(m))
    match = {"shard": "shard .* is corrupted", "values+checksum": "do not match their digests",
             "positions+checksum": "do not match their digests|escapes|run past"}[where]
    with pytest.raises(PayloadError, match=match):
        agent.sync_local()
    with agent.local.locked():
        assert agent.local.version == 1
        assert bit_equal(agent.local.tensors(), states[1]) == []
        assert agent.local.verify() == []
    assert str(root / "latest") in testing.HOOK_CALLS
    shard.write_bytes(good)                            # the publisher's bytes come back
    if where != "shard":
        m = raw_manifest(root, 2)
        from weightsync_disk_delta.layout import file_digest
        for s in m["shards"]:
            if s["file"] == shard.name:
                s["xxh3"] = file_digest(good)
        (root / "versions" / "v00000002" / "manifest.json").write_text(json.dumps(m))
    assert agent.sync_local() == 2 and bit_equal(agent.local.tensors(), states[2]) == []


def test_local_bytes_that_are_not_the_base_are_caught_and_replaced(tmp_path: Path, trainer: Trainer) -> None:
    """Bit rot in the host-local checkpoint, next to what a delta changes: the digest check on
    the written bytes fails, the data is discarded, and the agent reaches the version from the
    newest full one instead. The engine is never offered the bad bytes."""
    root = tmp_path / "root"
    states: dict = {}
    events: list[str] = []
    agent = Agent(root, tmp_path / "local", on_event=events.append)
    with WeightSync.from_config(publish_config(root)) as sync:
        _publish(trainer, sync, range(1, 2), states)
        assert agent.sync_local() == 1
        _publish(trainer, sync, range(2, 3), states)
    m = raw_manifest(root, 2)
    name = next(n for n, t in m["tensors"].items() if t["kind"] == "sparse" and t["changed"])
    info = agent.local.state()["tensors"][name]
    data_file = agent.local.data_dir() / info["file"]
    raw = bytearray(data_file.read_bytes())
    changed = set(_changed_positions(root, 2, name))
    pos = next(i for i in range(10**9) if i not in changed)
    raw[info["offset"] + 2 * pos] ^= 0x01              # an element the delta does not touch
    data_file.write_bytes(bytes(raw))
    assert agent.sync_local() == 2
    assert bit_equal(agent.local.tensors(), states[2]) == []
    assert agent.local.verify() == []
    assert any("do not match their digests" in e for e in events)
    assert any("installed full version 1" in e for e in events)


def _changed_positions(root: Path, version: int, name: str) -> list[int]:
    from weightsync.wire.frame import unpack
    from weightsync_disk_delta.codec import sparse_parts
    m = raw_manifest(root, version)
    t = m["tensors"][name]
    shard = root / "versions" / f"v{version:08d}" / t["shard"]
    arrays = dict(unpack(bytearray(shard.read_bytes()))[0])
    return sparse_parts(name, t, arrays, t["dtype"], t["shape"])[0].tolist()


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(reason=f"cannot mount a tmpfs here ({r.stderr.strip()}); needs root and "
                           f"CAP_SYS_ADMIN for a real full or read-only filesystem")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _remount(path: Path, opts: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{opts}", str(path)], check=True, capture_output=True)


def test_unwritable_root_gives_a_clear_error_and_keeps_latest(tmp_path: Path, trainer: Trainer) -> None:
    with tmpfs(tmp_path / "fs", "8m") as fs:
        root = fs / "root"
        states: dict = {}
        with WeightSync.from_config(publish_config(root)) as sync:
            _publish(trainer, sync, range(1, 2), states)
            _remount(fs, "ro")                          # root cannot bypass a read-only mount
            trainer.step()
            with pytest.raises(TransportError) as ei:
                sync.push(trainer.state(), version=2)
            msg = str(ei.value)
            assert "Read-only file system" in msg and "still points at version 1" in msg
            assert read_latest(root) == 1
            agent = Agent(root, tmp_path / "local")
            assert agent.sync_local() == 1 and bit_equal(agent.local.tensors(), states[1]) == []
            _remount(fs, "rw")                          # the encoding rolled back: v2 is a delta on 1
            states[2] = trainer.state()
            assert sync.push(states[2], version=2).ok
            assert raw_manifest(root, 2)["kind"] == "delta"
            assert agent.sync_local() == 2 and bit_equal(agent.local.tensors(), states[2]) == []


def test_full_disk_gives_a_clear_error_and_keeps_latest(tmp_path: Path, trainer: Trainer) -> None:
    with tmpfs(tmp_path / "fs", "600k") as fs:          # one full version fits, two do not
        root = fs / "root"
        states: dict = {}
        cfg = publish_config(root, density_threshold=0.0)   # every version ships whole
        with WeightSync.from_config(cfg) as sync:
            _publish(trainer, sync, range(1, 2), states)
            trainer.step()
            with pytest.raises(TransportError) as ei:
                sync.push(trainer.state(), version=2)
            msg = str(ei.value)
            assert "No space left on device" in msg and "still points at version 1" in msg
            assert read_latest(root) == 1 and list_versions(root) == [1]
            assert not [p for p in (root / "versions").iterdir() if p.name.startswith(".")]
            agent = Agent(root, tmp_path / "local")
            assert agent.sync_local() == 1 and bit_equal(agent.local.tensors(), states[1]) == []
            _remount(fs, "size=4m")
            states[2] = trainer.state()
            assert sync.push(states[2], version=2).ok
            assert agent.sync_local() == 2 and bit_equal(agent.local.tensors(), states[2]) == []
