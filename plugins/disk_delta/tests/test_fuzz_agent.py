"""Issue 18 item 4, the agent's part: generated and mutated manifests, shards, `latest` and
file types (links out of the root, FIFOs, /dev/zero, huge sparse files, missing files) fed to
the pull agent, on every kernel path. After every case: no exception other than weightsync's
own errors, nothing written outside the local directory (the published root and a directory
outside it are unchanged to the byte), the local checkpoint at one whole version as published
(never older than before; its bytes match its recorded digests, and those are what the
published manifests declare for that version), nothing half-made left, memory bounded.

The default run is deterministic (derandomize) and bounded by `max_examples`. A longer run:

    WEIGHTSYNC_FUZZ_EXAMPLES=20000 WEIGHTSYNC_FUZZ_SEED=7 \\
        python -m pytest plugins/disk_delta/tests/test_fuzz_agent.py -s

(the seed switches derandomize off, so each seed explores other cases). Each test prints how
many cases it ran."""

from __future__ import annotations

import json
import os
import resource
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from weightsync import WeightSync
from weightsync.errors import WeightSyncError
from weightsync_disk_delta import fuzz
from weightsync_disk_delta.agent import Agent
from weightsync_disk_delta.local import LocalCheckpoint
from weightsync_disk_delta.testing import (KERNEL_PATHS, digests, raw_manifest,
                                           use_kernel_path, version_dir)

EXAMPLES = int(os.environ.get("WEIGHTSYNC_FUZZ_EXAMPLES", "0"))
SEED = os.environ.get("WEIGHTSYNC_FUZZ_SEED")
MEMORY_KIB = 256 * 1024


def fuzz_settings(default: int, offset: int = 0) -> Callable[[Callable], Callable]:
    """Deterministic and bounded by default; WEIGHTSYNC_FUZZ_EXAMPLES / _SEED for longer runs
    (`offset` gives each parametrization a seed of its own)."""
    s = settings(max_examples=EXAMPLES or default, derandomize=SEED is None, database=None,
                 deadline=None, print_blob=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                        HealthCheck.data_too_large, HealthCheck.filter_too_much])

    def apply(fn: Callable) -> Callable:
        fn = s(fn)
        return seed(int(SEED) + offset)(fn) if SEED is not None else fn
    return apply


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"a.weight": torch.randn(24, 40, generator=g).to(torch.bfloat16),
            "b.bias": torch.randn(33, generator=g),
            "c.weight": torch.randn(7, 5, generator=g).to(torch.float16),
            "d.table": torch.randint(0, 255, (64,), generator=g, dtype=torch.uint8),
            "e.steps": torch.randint(-9, 9, (3,), generator=g, dtype=torch.int64),
            "x.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
            "z.empty": torch.zeros(0, dtype=torch.bfloat16)}


def _change(sd: dict[str, torch.Tensor], seed_: int, density: dict[str, float]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed_)
    out = {}
    for n, t in sd.items():
        t = t.clone()
        flat = t.view(-1)
        k = int(density.get(n, 0) * flat.numel())
        if k:
            idx = torch.randperm(flat.numel(), generator=g)[:k]
            flat[idx] = (flat[idx].to(torch.float32) + 1 + torch.rand(k, generator=g) * 3).to(t.dtype)
        out[n] = t
    return out


class Template:
    """Versions 1 (full), 2 and 3 (deltas: sparse gap-coded, xor, whole tensors inside a delta,
    several shards each) and a host at version 1; a directory outside the root that holds
    exact copies of the published files."""

    def __init__(self, base: Path) -> None:
        self.base = base
        s1 = _model()
        s2 = _change(s1, 2, {"a.weight": 0.01, "b.bias": 0.7, "c.weight": 0.06, "d.table": 0.2,
                             "e.steps": 0.4})
        s3 = _change(s2, 3, {"a.weight": 0.02, "b.bias": 0.05, "d.table": 0.03})
        for s, start in ((s2, 100), (s3, 2000)):     # a run of low-bit flips: the xor form wins
            s["x.weight"].view(torch.int16).view(-1)[start: start + 600] ^= 1
        self.states = {1: s1, 2: s2, 3: s3}
        self.digests = {v: digests(s) for v, s in self.states.items()}
        self.root = base / "template" / "root"
        enc = {"density_threshold": 0.5, "xor_min_density": 0.1, "xor_max_ratio": 1.0,
               "full_when_chain_exceeds": 0}
        cfg = {"encoding": {"kind": "delta", "options": enc},
               "transport": {"kind": "disk_delta", "options": {"root": str(self.root), "fsync": False}},
               "exporter": {"kind": "torch", "options": {"bucket_bytes": 2048}},
               "sync": {"progress": "off"}}
        with WeightSync.from_config(cfg) as sync:
            for v, sd in self.states.items():
                assert sync.push(sd, version=v).ok
        self.local = base / "template" / "local"
        assert Agent(self.root, self.local).sync_local(1) == 1
        self.outside = base / "outside"
        shutil.copytree(self.root, self.outside / "root")
        self.outside_snap = snapshot(self.outside)
        self.root_snap = snapshot(self.root)
        kinds = {t["kind"] for v in (2, 3) for t in raw_manifest(self.root, v)["tensors"].values()}
        assert kinds == {"full", "sparse", "xor"}, kinds
        assert all(len(raw_manifest(self.root, v)["shards"]) > 1 for v in (1, 2, 3))
        self.cases = 0


def snapshot(top: Path, skip: Path | None = None) -> dict[str, tuple]:
    """path -> (type, size, mtime, link target) of everything under `top` (not following
    links), `skip` left out."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        d = Path(dirpath)
        if skip is not None and d == skip:
            dirnames.clear()
            continue
        for name in dirnames + filenames:
            p = d / name
            if skip is not None and p == skip:
                continue
            st_ = os.lstat(p)
            link = os.readlink(p) if stat.S_ISLNK(st_.st_mode) else None
            out[str(p.relative_to(top))] = (stat.S_IFMT(st_.st_mode), st_.st_size, st_.st_mtime_ns, link)
    return out


def _scratch(fallback: Path) -> Path:
    """A directory for the cases: on a tmpfs where there is one (thousands of small trees are
    made and removed; on a disk that is most of the time)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="weightsync-fuzz-", dir=shm))
    return fallback


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Template]:
    base = _scratch(tmp_path_factory.mktemp("fuzz"))
    try:
        yield Template(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- what a case does to the published root ----------------------------------------------------

def _put(p: Path, data: bytes | str) -> None:
    """Write a new file at `p`: the case's root is hard-linked to the template's files, so a
    file is replaced, never written in place."""
    p.unlink(missing_ok=True)
    if isinstance(data, str):
        p.write_text(data)
    else:
        p.write_bytes(data)


def _fix_shard(root: Path, v: int, f: str, data: bytes) -> None:
    """A shard replaced and the manifest's size and checksum made to match it."""
    import xxhash
    _put(version_dir(root, v) / f, data)
    m = raw_manifest(root, v)
    for s in m["shards"]:
        if s["file"] == f:
            s["bytes"], s["xxh3"] = len(data), xxhash.xxh3_128(data).hexdigest()
    _put(version_dir(root, v) / "manifest.json", json.dumps(m))


def _inside(root: Path, p: Path) -> bool:
    """The harness edits only files really inside the case's root (an earlier edit may have
    turned a directory into a link to the outside copy, which must stay as it is)."""
    return os.path.realpath(p).startswith(os.path.realpath(root) + os.sep) and \
        (not os.path.lexists(p) or os.path.isfile(p) and not os.path.islink(p)
         and os.path.getsize(p) < 1 << 20)       # nor a huge file an earlier edit made


def _shards(root: Path, v: int) -> list[str]:
    try:
        return sorted(p.name for p in version_dir(root, v).iterdir() if p.name.startswith("shard-"))
    except OSError:
        return []


def _edit_manifest(data: st.DataObject, root: Path, t: Template) -> None:
    v = data.draw(st.integers(1, 3), label="version")
    p = version_dir(root, v) / "manifest.json"
    if not _inside(root, p):
        return
    try:
        m = json.loads(p.read_bytes())
    except (OSError, ValueError):
        return
    how = data.draw(st.sampled_from(["field", "json", "bytes"]), label="manifest edit")
    if how == "field":
        _put(p, json.dumps(data.draw(fuzz.manifest_edit(m))))
    elif how == "json":
        _put(p, json.dumps(data.draw(fuzz.mutated_json(m))))
    else:
        _put(p, data.draw(fuzz.mutated_bytes(p.read_bytes())))


def _edit_shard(data: st.DataObject, root: Path, t: Template) -> None:
    v = data.draw(st.integers(1, 3), label="version")
    files = _shards(root, v)
    if not files:
        return
    f = data.draw(st.sampled_from(files), label="shard")
    p = version_dir(root, v) / f
    if not _inside(root, p) or not _inside(root, version_dir(root, v) / "manifest.json"):
        return
    raw = p.read_bytes()
    how = data.draw(st.sampled_from(["bytes", "header", "arrays"]), label="shard edit")
    if how == "bytes":
        new = data.draw(fuzz.mutated_bytes(raw))
    elif how == "header":
        try:
            new = data.draw(fuzz.mutated_safetensors(raw))
        except (ValueError, KeyError, TypeError, AttributeError):
            return
    else:
        new = _edit_arrays(data, raw)
    if data.draw(st.booleans(), label="checksum fixed"):     # corrupted before it was hashed
        try:
            _fix_shard(root, v, f, new)
        except (OSError, ValueError, KeyError, TypeError):
            _put(p, new)
    else:
        _put(p, new)


def _edit_arrays(data: st.DataObject, raw: bytes) -> bytes:
    """Replace, drop or add one array (positions near the tensor's size, values of any dtype)."""
    from weightsync.wire.frame import unpack
    try:
        arrays = {n: a.clone() for n, a in unpack(bytearray(raw))[0]}
    except (WeightSyncError, ValueError, RuntimeError, TypeError, AttributeError):
        return raw                                   # an earlier edit left no safetensors file
    if not arrays:
        return raw
    key = data.draw(st.sampled_from(sorted(arrays)), label="array")
    how = data.draw(st.sampled_from(["replace", "positions", "drop", "add"]), label="array edit")
    if how == "drop":
        del arrays[key]
    elif how == "add":
        arrays.update(data.draw(fuzz.arrays([key.rpartition("::")[0] + "::" +
                                             data.draw(st.sampled_from(["idx", "val", "far", "gap8",
                                                                        "xor", "full", "old"]))])))
    elif how == "positions" and key.endswith(("::idx", "::far")):
        arrays[key] = data.draw(fuzz.positions_like(arrays[key].numel(), data.draw(
            st.sampled_from([0, 1, 5, 33, 64, 960, 4096]))))
    else:
        arrays.update(data.draw(fuzz.arrays([key])))
    return fuzz.safetensors_bytes(arrays)


def _edit_file_kind(data: st.DataObject, root: Path, t: Template) -> None:
    """Replace a published file or directory by a link (outside the root, to /dev/zero, to
    another version), a FIFO, a directory, an empty or a huge sparse file, or nothing."""
    v = data.draw(st.integers(1, 3), label="version")
    files = _shards(root, v)
    targets = ["latest", "versions", "vdir", "manifest"] + (["shard"] * 3 if files else [])
    which = data.draw(st.sampled_from(targets), label="target")
    f = data.draw(st.sampled_from(files)) if which == "shard" else None
    rel = {"latest": "latest", "versions": "versions", "vdir": f"versions/v{v:08d}",
           "manifest": f"versions/v{v:08d}/manifest.json",
           "shard": f"versions/v{v:08d}/{f}"}[which]
    p = root / rel
    if not os.path.lexists(p) or not os.path.realpath(p.parent).startswith(os.path.realpath(root)):
        return
    kind = data.draw(st.sampled_from(["outside", "devzero", "other", "fifo", "dir", "empty", "huge",
                                      "missing"]), label="file kind")
    if kind == "huge" and p.is_dir():
        kind = "missing"
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()
    if kind == "outside":
        p.symlink_to(t.outside / "root" / rel)
    elif kind == "devzero":
        p.symlink_to("/dev/zero")
    elif kind == "other":
        p.symlink_to(t.outside / "root" / rel.replace(f"v{v:08d}", f"v{v % 3 + 1:08d}"))
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "dir":
        p.mkdir()
    elif kind == "empty":
        _put(p, b"")
    elif kind == "huge":
        with open(p, "wb") as fh:
            fh.truncate(1 << 30)
        if which == "shard" and _inside(root, version_dir(root, v) / "manifest.json") and \
                data.draw(st.booleans(), label="manifest claims it"):
            try:
                m = raw_manifest(root, v)
                for s in m["shards"]:
                    if s["file"] == f:
                        s["bytes"] = 1 << 30
            except (OSError, ValueError, KeyError, TypeError):
                return
            _put(version_dir(root, v) / "manifest.json", json.dumps(m))


def _edit_latest(data: st.DataObject, root: Path, t: Template) -> None:
    p = root / "latest"
    if not os.path.isfile(p) or not _inside(root, p):     # an earlier edit may have removed it
        return
    how = data.draw(st.sampled_from(["version", "json", "bytes"]), label="latest edit")
    if how == "version":
        v = data.draw(st.sampled_from([0, 1, 2, 4, 99]))
        _put(p, json.dumps({"version": v, "dir": f"versions/v{v:08d}"}))
    elif how == "json":
        try:
            doc = json.loads(p.read_bytes())
        except ValueError:
            return
        _put(p, json.dumps(data.draw(fuzz.mutated_json(doc))))
    else:
        _put(p, data.draw(fuzz.mutated_bytes(p.read_bytes())))


EDITS = [_edit_manifest, _edit_manifest, _edit_shard, _edit_shard, _edit_shard, _edit_file_kind,
         _edit_latest]


# -- what must hold after every case ------------------------------------------------------------

def _declared(root: Path, start: dict[str, str] | None, v: int) -> dict[str, str] | None:
    """The digests the published manifests (as they are now) declare for version `v`, starting
    from `start` at version 1 (None: from version 1's own manifest)."""
    def manifest(u: int) -> Any:
        p = version_dir(root, u) / "manifest.json"
        if not _inside(root, p):            # a link, a FIFO, a huge file: never applied anyway
            raise ValueError(p)
        return json.loads(p.read_bytes())
    try:
        d = dict(start) if start is not None else \
            {n: e["digest"] for n, e in manifest(1)["tensors"].items()}
        for u in range(2, v + 1):
            m = manifest(u)
            entries = {n: e["digest"] for n, e in m["tensors"].items()}
            d = entries if m["kind"] == "full" else {**d, **entries}
        return d
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def check_case(t: Template, case: Path, before: dict[str, tuple], rss0: int) -> int:
    local = case / "local"
    assert snapshot(case, skip=local) == before, "something outside the local directory changed"
    assert snapshot(t.outside) == t.outside_snap, "a file outside the root was written"
    lc = LocalCheckpoint(local)
    with lc.locked():
        v = lc.version
        assert v is not None and v >= 1, f"the host lost or rewound its checkpoint (version {v})"
        assert lc.verify() == [], f"version {v}: bytes differ from the recorded digests"
        got = {n: i["digest"] for n, i in lc.state()["tensors"].items()}
        assert got in (t.digests.get(v), _declared(case / "root", t.digests[1], v),
                       _declared(case / "root", None, v)), f"version {v} is not as published"
        names = sorted(p.name for p in local.iterdir())
        assert names == [".lock", lc.data_dir().name, "model"], names
        assert not [p.name for p in lc.data_dir().iterdir() if p.name.startswith(".")
                    or p.name == "journal"]
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    assert grown < MEMORY_KIB, f"the agent's peak memory grew by {grown} KiB in this case"
    return v


def _rss_kib() -> int:
    """The resident memory now (ru_maxrss is the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_fuzz_the_agent_with_broken_publications(template: Template, path: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    use_kernel_path(path, monkeypatch)
    ran: dict[str, Any] = {"cases": 0, "versions": {}}
    start = _rss_kib()

    @fuzz_settings(default=900, offset=KERNEL_PATHS.index(path))
    @given(data=st.data())
    def case(data: st.DataObject) -> None:
        c = Path(tempfile.mkdtemp(dir=template.base))
        try:
            shutil.copytree(template.root, c / "root", symlinks=True, copy_function=os.link)
            shutil.copytree(template.local, c / "local", symlinks=True, copy_function=shutil.copyfile)
            for edit in data.draw(st.lists(st.sampled_from(EDITS), min_size=1, max_size=3), label="edits"):
                edit(data, c / "root", template)
            before = snapshot(c, skip=c / "local")
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss     # the peak so far
            try:
                Agent(c / "root", c / "local").sync_local()
            except WeightSyncError:
                pass
            v = check_case(template, c, before, rss0)
            ran["cases"] += 1
            ran["versions"][v] = ran["versions"].get(v, 0) + 1
        finally:
            shutil.rmtree(c, ignore_errors=True)

    case()
    print(f"\nfuzz ({path}): {ran['cases']} cases, versions reached {dict(sorted(ran['versions'].items()))}")
    assert ran["versions"].get(3, 0) and ran["versions"].get(1, 0)      # both outcomes occur
    assert _rss_kib() - start < MEMORY_KIB, "memory grew over the cases"
    assert snapshot(template.root) == template.root_snap, "the harness changed the template"


class _Crash(BaseException):
    """Stands for the agent dying right after it committed a journal."""


@pytest.fixture(scope="module")
def journaled(template: Template) -> Path:
    """A host at version 1 with version 2's journal committed and not yet written (a crash)."""
    from weightsync_disk_delta.local import LocalCheckpoint as LC
    local = template.base / "journaled"
    shutil.copytree(template.local, local, symlinks=True)
    real = LC._forward

    def crash(self: LC, d: Path, j: Any, live: bool) -> None:
        raise _Crash()
    LC._forward = crash                                      # type: ignore[method-assign]
    try:
        with pytest.raises(_Crash):
            Agent(template.root, local).sync_local(2)
    finally:
        LC._forward = real                                   # type: ignore[method-assign]
    assert (LocalCheckpoint(local).data_dir() / "journal").is_dir()
    return local


def _edit_journal(data: st.DataObject, j: Path) -> None:
    try:
        _edit_journal_file(data, j)
    except (ValueError, KeyError, TypeError, AttributeError, WeightSyncError):
        pass                             # an earlier edit left a file this edit cannot parse


def _edit_journal_file(data: st.DataObject, j: Path) -> None:
    which = data.draw(st.sampled_from(["changes.safetensors", "journal.json", "undo.safetensors"]),
                      label="journal file")
    p = j / which
    if which == "undo.safetensors" and not p.exists():
        names = json.loads((j / "journal.json").read_bytes())["new"]["tensors"]
        arrays = data.draw(fuzz.arrays([n + "::old" for n in sorted(names)[:3]]))
        p.write_bytes(fuzz.safetensors_bytes(arrays))
        return
    raw = p.read_bytes()
    how = data.draw(st.sampled_from(["bytes", "structure"]), label="journal edit")
    if how == "bytes":
        p.write_bytes(data.draw(fuzz.mutated_bytes(raw)))
    elif which == "journal.json":
        p.write_text(json.dumps(data.draw(fuzz.mutated_json(json.loads(raw)))))
    else:
        if data.draw(st.booleans(), label="header"):
            p.write_bytes(data.draw(fuzz.mutated_safetensors(raw)))
        else:
            p.write_bytes(_edit_arrays(data, raw))


@pytest.mark.parametrize("path", ["numba", "numpy"])
def test_fuzz_the_replay_of_a_damaged_journal(template: Template, journaled: Path, path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A journal damaged on the host's own disk (it is never read from the shared root):
    opening the checkpoint finishes it, or discards the copy as a whole; never an exception,
    never a write outside the local directory, never a mixed version."""
    use_kernel_path(path, monkeypatch)
    ran: dict[str, Any] = {"cases": 0, "versions": {}}

    @fuzz_settings(default=150, offset=len(KERNEL_PATHS) + ["numba", "numpy"].index(path))
    @given(data=st.data())
    def case(data: st.DataObject) -> None:
        c = Path(tempfile.mkdtemp(dir=template.base))
        try:
            local = c / "local"
            shutil.copytree(journaled, local, symlinks=True)
            j = LocalCheckpoint(local).data_dir() / "journal"
            for _ in range(data.draw(st.integers(1, 2), label="edits")):
                _edit_journal(data, j)
            before = snapshot(template.base, skip=c)
            lc = LocalCheckpoint(local)
            with lc.locked():
                v = lc.version
                if v is None:
                    assert lc.data_dir() is None and not lc.model_dir.exists()
                    assert sorted(p.name for p in local.iterdir()) == [".lock"]
                else:
                    assert lc.verify() == [], f"version {v} does not match its digests"
                    assert not (lc.data_dir() / "journal").exists()
            assert snapshot(template.base, skip=c) == before
            ran["cases"] += 1
            ran["versions"][v] = ran["versions"].get(v, 0) + 1
        finally:
            shutil.rmtree(c, ignore_errors=True)

    case()
    print(f"\nfuzz journal ({path}): {ran['cases']} cases, outcomes {ran['versions']}")
    assert ran["versions"].get(None, 0) and ran["versions"].get(2, 0)
