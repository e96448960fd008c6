"""Issue 18, the agent's part of the table: a published version that does not fit the host-local
checkpoint (another shape, positions past a tensor's end, a larger shape claimed, badly typed
fields, unlisted arrays) is refused with a clear error before a journal is written; nothing is
applied and the checkpoint stays one whole version. Every case runs on each kernel path."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import save_file

from weightsync.errors import PayloadError
from weightsync_disk_delta.agent import Agent
from weightsync_disk_delta.local import LocalCheckpoint
from weightsync_disk_delta.testing import (next_version, publish, raw_manifest, set_shard_arrays,
                                           shard_arrays, small_model, version_dir, whole_version,
                                           write_manifest)

SHARD = "shard-00000.safetensors"


@pytest.fixture
def hosted(tmp_path: Path) -> dict[str, Any]:
    """Versions 1 (full), 2 and 3 (deltas) of 12 small tensors; a host at version 1."""
    s1 = small_model()
    states = {1: s1, 2: next_version(s1, 2), 3: next_version(next_version(s1, 2), 3)}
    root = tmp_path / "root"
    publish(root, {1: s1})
    events: list[str] = []
    agent = Agent(root, tmp_path / "local", on_event=events.append)
    assert agent.sync_local() == 1
    publish_rest(root, states)
    return {"root": root, "states": states, "agent": agent, "events": events,
            "seen": len(events), "files": _files(tmp_path / "local")}


def publish_rest(root: Path, states: dict[int, Any]) -> None:
    """Versions 2 and 3 on top of 1, by a trainer that starts from version 1's checkpoint."""
    base = root.parent / "base"
    base.mkdir(exist_ok=True)
    save_file({n: t.contiguous() for n, t in states[1].items()}, str(base / "model.safetensors"))
    publish(root, {2: states[2], 3: states[3]}, base_checkpoint=str(base), base_version=1)


def _files(local: Path) -> dict[str, str]:
    """Digest of every file in the local data directory (to show nothing was written)."""
    d = LocalCheckpoint(local).data_dir()
    assert d is not None
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file()}


def assert_untouched(h: dict[str, Any], match: str) -> str:
    """sync_local refuses with `match`; the local checkpoint is whole version 1, byte for byte
    as before, with no journal; returns the message."""
    with pytest.raises(PayloadError, match=match) as ei:
        h["agent"].sync_local()
    msg = str(ei.value)
    assert "stays at version 1" in msg or "is at version 1" in msg, msg
    assert "tries again" in msg, msg                           # what happens next, what to do
    assert whole_version(h["agent"].local.path, h["states"]) == 1
    assert _files(h["agent"].local.path) == h["files"]
    assert not any("installed full" in e for e in h["events"][h["seen"]:])
    return msg


def test_the_fixture_applies_cleanly(hosted: dict[str, Any], kernel_path: str) -> None:
    assert hosted["agent"].sync_local() == 3
    assert whole_version(hosted["agent"].local.path, hosted["states"]) == 3


def test_a_full_entry_of_another_shape_is_refused_before_anything_is_written(
        tmp_path: Path, kernel_path: str) -> None:
    """The issue's first row: a trainer changed one tensor's shape, so version 2 carries it as a
    `full` entry of another shape among 11 deltas. The agent used to write 11 tensors, crash,
    and replay the journal into a crash at every restart."""
    s1 = small_model()
    s2 = next_version(s1, 2)
    s2["layers.10.w"] = torch.randn(40, 64).to(torch.bfloat16)        # the last of 12
    root = tmp_path / "root"
    publish(root, {1: s1})
    agent = Agent(root, tmp_path / "local")
    assert agent.sync_local() == 1
    before = _files(agent.local.path)
    publish_rest(root, {1: s1, 2: s2, 3: next_version(s2, 3)})
    m = raw_manifest(root, 2)
    assert m["kind"] == "delta" and m["tensors"]["layers.10.w"]["kind"] == "full"
    with pytest.raises(PayloadError) as ei:
        agent.sync_local()
    msg = str(ei.value)
    assert "tensor 'layers.10.w' is bfloat16 [40, 64] in the manifest, but bfloat16 [48, 64] in " \
           "the local checkpoint" in msg and "publish a full version for that" in msg, msg
    assert "stays at version 1" in msg
    assert whole_version(agent.local.path, {1: s1}) == 1 and _files(agent.local.path) == before
    assert not (agent.local.data_dir() / "journal").exists()
    with pytest.raises(PayloadError, match="in the local checkpoint"):          # and again: the same
        agent.sync_local()
    assert whole_version(agent.local.path, {1: s1}) == 1


def test_a_journal_that_does_not_fit_is_discarded_not_replayed_into_a_crash(hosted: dict[str, Any]) -> None:
    """A journal as the old agent left it (a whole tensor of another size, positions past the
    end): a new process opening the checkpoint discards the copy instead of crashing (the
    issue saw SIGSEGV there), and the next sync installs the newest full version again."""
    lc = hosted["agent"].local
    d, s = lc.data_dir(), lc.state()
    (d / "journal").mkdir()
    save_file({"layers.10.w::full": torch.zeros(40 * 64, dtype=torch.int16),
               "layers.3.w::idx": torch.tensor([5, 3071, 9000], dtype=torch.int32),
               "layers.3.w::val": torch.ones(3, dtype=torch.int16)},
              str(d / "journal" / "changes.safetensors"))
    new = {"version": 2, "tensors": s["tensors"]}
    (d / "journal" / "journal.json").write_text(json.dumps({"old": s, "new": new, "pos": {}}))
    code = ("from weightsync_disk_delta.local import LocalCheckpoint\n"
            f"lc = LocalCheckpoint({str(lc.path)!r})\n"
            "with lc.locked():\n    print('version', lc.version)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]                # no SIGSEGV, no traceback
    assert "version None" in r.stdout and "discarded" in r.stderr, r.stderr[-3000:]
    assert lc.data_dir() is None and not lc.model_dir.exists()     # nothing mixed to load
    assert hosted["agent"].sync_local() == 3
    assert whole_version(lc.path, hosted["states"]) == 3


def _sparse(h: dict[str, Any], name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return shard_arrays(h["root"], 2, SHARD), raw_manifest(h["root"], 2)


@pytest.mark.parametrize("form", ["idx", "gap8"])
def test_positions_past_a_tensors_end_are_refused(hosted: dict[str, Any], kernel_path: str,
                                                  form: str) -> None:
    """The issue's second row: positions past a tensor's end wrote into the neighbouring tensor
    (Python hash path) or were dropped silently (native path)."""
    root, name = hosted["root"], "layers.4.w"
    arrays, m = _sparse(hosted, name)
    for k in [k for k in arrays if k.startswith(name + "::") and not k.endswith("::val")]:
        del arrays[k]
    vals = arrays[name + "::val"]
    numel = 48 * 64
    idx = torch.arange(numel - vals.numel() + 3, numel + 3, dtype=torch.int32)     # 3 past the end
    if form == "idx":
        arrays[name + "::idx"] = idx
    else:
        gaps = torch.diff(idx, prepend=torch.tensor([-1], dtype=torch.int32))
        gaps[0] = 0
        arrays[name + "::gap8"] = gaps.to(torch.uint8)
        arrays[name + "::far"] = idx[:1] + 1
    m["tensors"][name]["pos"] = form
    write_manifest(root, 2, m)
    set_shard_arrays(root, 2, SHARD, arrays)
    assert_untouched(hosted, r"positions (are out of range 0\.\.3071|do not match their escapes or "
                             r"run past the tensor's 3072 elements)")


def test_a_manifest_claiming_a_larger_shape_is_refused(hosted: dict[str, Any], kernel_path: str) -> None:
    """The issue: a manifest claiming shape [4096] for a [32] tensor was accepted, and its
    positions (inside 4096) were checked against the claim."""
    root = hosted["root"]
    arrays, m = _sparse(hosted, "norm.weight")
    for k in [k for k in arrays if k.startswith("norm.weight::")]:
        del arrays[k]
    arrays["norm.weight::idx"] = torch.tensor([1, 100, 4000], dtype=torch.int32)
    arrays["norm.weight::val"] = torch.ones(3)
    m["tensors"]["norm.weight"].update(shape=[4096], pos="idx")
    write_manifest(root, 2, m)
    set_shard_arrays(root, 2, SHARD, arrays)
    msg = assert_untouched(hosted, "tensor 'norm.weight' is float32 \\[4096\\] in the manifest, but "
                                   "float32 \\[32\\] in the local checkpoint")
    assert "cannot reach version 3" in msg


def test_another_dtype_is_refused(hosted: dict[str, Any]) -> None:
    m = raw_manifest(hosted["root"], 2)
    m["tensors"]["layers.0.w"]["dtype"] = "float16"
    write_manifest(hosted["root"], 2, m)
    assert_untouched(hosted, "is float16 \\[48, 64\\] in the manifest, but bfloat16")


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node: Any = m
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[int(last) if isinstance(node, list) else last] = value
    return edit


def _add_tensor(m: dict[str, Any]) -> None:
    m["tensors"]["../../etc/passwd"] = dict(m["tensors"]["layers.0.w"])


@pytest.mark.parametrize("edit,match", [
    (_set("shards/0/bytes", "abc"), "shards.0.bytes: Input should be a valid integer"),
    (_set("tensors/layers.0.w/shape", "abc"), "tensors.layers.0.w.shape: Input should be a valid"),
    (_set("tensors/layers.0.w/shape", [48, -64]), "greater than or equal to 0"),
    (_set("tensors/layers.0.w/dtype", "complex128"), "tensors.layers.0.w.dtype: Input should be"),
    (_set("tensors/layers.0.w/digest", 7), "tensors.layers.0.w.digest: Input should be a valid string"),
    (_set("tensors/layers.0.w/kind", "rot13"), "tensors.layers.0.w.kind: Input should be"),
    (_set("tensors/layers.0.w/pos", "gap32"), "tensors.layers.0.w.pos: Input should be"),
    (_set("tensors/layers.0.w/shard", "../../v00000001/shard-00000.safetensors"), "String should match"),
    (_set("shards/0/file", "/dev/zero"), "shards.0.file: String should match"),
    (_set("version", "2"), "version: Input should be a valid integer"),
    (_set("base_version", True), "base_version: Input should be a valid integer"),
    (_set("kind", "partial"), "kind: Input should be 'full' or 'delta'"),
    (_set("tensors", [1, 2]), "tensors: Input should be an object"),
    (_set("format", "weightsync-disk-delta/9"), "format: Input should be"),
    (_add_tensor, "tensor name '../../etc/passwd' is not allowed"),
])
def test_badly_typed_fields_are_refused_by_the_schema(hosted: dict[str, Any], edit: Callable,
                                                      match: str) -> None:
    """The issue's third row: `"bytes": "abc"`, a string shape... used to raise uncaught
    exceptions deep inside the apply (and end loop mode)."""
    m = raw_manifest(hosted["root"], 2)
    edit(m)
    write_manifest(hosted["root"], 2, m)
    msg = assert_untouched(hosted, "does not follow the manifest schema")
    assert match in msg, msg


@pytest.mark.parametrize("raw", [b"", b"{", b"[" * 100_000, b"\xff\xfe\x00", b"null", b"1e999999"])
def test_a_manifest_that_is_not_json_is_refused(hosted: dict[str, Any], raw: bytes) -> None:
    (version_dir(hosted["root"], 2) / "manifest.json").write_bytes(raw)
    assert_untouched(hosted, "version 2: .* does not follow the manifest schema")


@pytest.mark.parametrize("where", ["delta", "full"])
def test_an_unlisted_array_in_a_shard_is_refused(hosted: dict[str, Any], where: str) -> None:
    """The issue's third row: an unlisted tensor in a full shard (an exception then); a delta
    shard with an extra array the same."""
    root = hosted["root"]
    v = 2 if where == "delta" else 1
    arrays = shard_arrays(root, v, SHARD)
    arrays["layers.99.w"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    set_shard_arrays(root, v, SHARD, arrays)
    if where == "delta":
        assert_untouched(hosted, "holds arrays the manifest does not list: \\['layers.99.w'\\]")
    else:                                       # a new host starting from the full version
        events: list[str] = []
        agent = Agent(root, root.parent / "new-host", on_event=events.append)
        with pytest.raises(PayloadError, match="holds arrays the manifest does not list") as ei:
            agent.sync_local()
        assert "the local checkpoint is at no version yet" in str(ei.value)
        assert whole_version(agent.local.path, hosted["states"]) is None
        assert [p.name for p in agent.local.path.iterdir()] == [".lock"]


def test_a_missing_array_is_refused(hosted: dict[str, Any]) -> None:
    arrays = shard_arrays(hosted["root"], 2, SHARD)
    del arrays["layers.5.w::val"]
    set_shard_arrays(hosted["root"], 2, SHARD, arrays)
    assert_untouched(hosted, "no arrays for: \\['layers.5.w::val'\\]")


@pytest.mark.parametrize("header", [
    b'[1, 2]', b'{"a": 5}', b'{"layers.0.w::val": {"dtype": "BF16", "shape": [-1, -2], '
                           b'"data_offsets": [0, 4]}}',
    b'{"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}',
    b'{"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 99999]}}',
])
def test_a_malformed_shard_header_is_refused(hosted: dict[str, Any], header: bytes) -> None:
    """A checksum that matches does not make a shard well formed: its header is checked
    against a schema before any array is made from it (core's `unpack` raised a bare error
    on negative dimensions or a header that is a list)."""
    from weightsync_disk_delta.testing import rewrite_shard
    body = len(header).to_bytes(8, "little") + header + bytes(64)
    rewrite_shard(hosted["root"], 2, SHARD, body)
    assert_untouched(hosted, "safetensors header|header entry|data offsets")


def test_the_whole_chain_is_checked_before_anything_is_applied(hosted: dict[str, Any]) -> None:
    """Version 3 does not fit what version 2 leaves (its base digest is another tensor's):
    version 2 is not applied either, so the host does not stop half way on a version it then
    cannot leave."""
    m = raw_manifest(hosted["root"], 3)
    m["tensors"]["layers.1.w"]["base_digest"] = "0" * 32
    write_manifest(hosted["root"], 3, m)
    assert_untouched(hosted, "version 3: tensor 'layers.1.w' was made against other bytes than "
                             "version 2 holds")


def test_a_shard_larger_than_its_tensors_allow_is_not_read(hosted: dict[str, Any]) -> None:
    """A manifest cannot make the agent read more than its tensors can take: a shard claiming
    (and holding, as a sparse file) 1 GiB for a few KiB of deltas is refused unread."""
    root = hosted["root"]
    shard = version_dir(root, 2) / SHARD
    with open(shard, "r+b") as f:
        f.truncate(1 << 30)
    m = raw_manifest(root, 2)
    m["shards"][0]["bytes"] = 1 << 30
    write_manifest(root, 2, m)
    assert_untouched(hosted, f"shard {SHARD} claims {1 << 30} bytes, more than its tensors can take")


def test_a_shard_of_another_size_than_the_manifest_says_is_not_read(hosted: dict[str, Any]) -> None:
    shard = version_dir(hosted["root"], 2) / SHARD
    with open(shard, "ab") as f:
        f.write(bytes(100))
    assert_untouched(hosted, f"shard {SHARD} holds \\d+ bytes, the manifest says \\d+")


def test_a_corrupt_later_version_stops_the_chain_before_the_first_is_written(
        hosted: dict[str, Any]) -> None:
    """Version 3's shard fails its checksum: version 2 (fine) is not applied either."""
    shard = version_dir(hosted["root"], 3) / SHARD
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x10
    shard.write_bytes(bytes(data))
    assert_untouched(hosted, f"version 3: shard .*{SHARD} is corrupted")
