"""The host-local checkpoint a pull agent keeps and its engines reload from.

    LOCAL/.lock                 flock: exclusive to change, shared while an engine reads
    LOCAL/model -> data-<id>    symlink, swapped atomically (a fresh full copy)
    LOCAL/data-<id>/*.safetensors, state.json {"version", "tensors": {name: file, offset, digest}}
    LOCAL/data-<id>/journal/    a committed redo journal (changes.safetensors + journal.json)

A delta is applied in place, through a journal: the changed positions (in the delta's compact
form) with their new values are written and flushed under a temporary name, renamed to `journal`
(the commit point), the new values are written into the data files while the ones they replace
are kept in memory, each changed tensor's digest is checked on the bytes now in the file, then
state.json moves to the new version and the journal is dropped. `recover()` replays a committed
journal and deletes anything half-made, so after a crash at any moment the checkpoint holds one
whole version: the old one, or the new one.

Checking after writing reads the changed tensors once, from the page cache (one pass writes and
hashes, kernels.swap); checking before writing would read, patch and hash them and then write
them as well. A digest that does not match puts the old values back, so the old version stays
current."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import shutil
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import save_file

from weightsync.bucket import dtype_from_name, tensor_digest, tensor_header
from weightsync.errors import PayloadError
from weightsync.parallel import map_threads
from weightsync.wire import unpack

from . import kernels, positions
from .hashing import Digest
from .layout import atomic_write, fsync_dir, write_file

_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=dtype_from_name(dtype)).element_size()


def tensor_offsets(path: Path) -> dict[str, dict[str, Any]]:
    """name -> {offset (absolute, in bytes), dtype, shape} of a safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        hlen = int.from_bytes(head, "little")
        header = json.loads(f.read(hlen))
    header.pop("__metadata__", None)
    from weightsync.wire import _ST_NAMES
    out = {}
    for name, info in header.items():
        start, _ = info["data_offsets"]
        out[name] = {"offset": 8 + hlen + int(start), "dtype": _ST_NAMES[info["dtype"]],
                     "shape": [int(d) for d in info["shape"]]}
    return out


class LocalCheckpoint:
    def __init__(self, path: str | Path, fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = None

    # -- locking ----------------------------------------------------------------------------
    @contextmanager
    def locked(self, exclusive: bool = True) -> Iterator[LocalCheckpoint]:
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            if exclusive:
                self.recover()
            yield self
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # -- state ------------------------------------------------------------------------------
    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    def data_dir(self) -> Path | None:
        link = self.model_dir
        if not link.is_symlink():
            return None
        d = self.path / os.readlink(link)
        return d if d.is_dir() else None

    def state(self) -> dict[str, Any] | None:
        d = self.data_dir()
        if d is None:
            return None
        try:
            return json.loads((d / "state.json").read_bytes())
        except (FileNotFoundError, ValueError):
            return None

    @property
    def version(self) -> int | None:
        s = self.state()
        return None if s is None else int(s["version"])

    def recover(self) -> None:
        """Finish or undo whatever a crashed writer left (call under the exclusive lock)."""
        d = self.data_dir()
        for p in self.path.iterdir():          # unfinished copies, swapped-out data, temp links
            if p.name.startswith((".model", "data-")) and (d is None or p.resolve() != d.resolve()):
                if p.is_symlink() or p.is_file():
                    p.unlink(missing_ok=True)
                else:
                    shutil.rmtree(p, ignore_errors=True)
        if d is None:
            return
        for p in d.iterdir():
            if p.name.startswith((".journal-", ".state.json.tmp")):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        if (d / "journal").is_dir():
            try:
                self._redo(d)
            except PayloadError:
                pass                      # the data was discarded; the next sync installs a full one

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the current version (copies), for checks and tests."""
        d, s = self.data_dir(), self.state()
        if d is None or s is None:
            return {}
        return {n: self.read_tensor(d, info) for n, info in s["tensors"].items()}

    def read_tensor(self, d: Path, info: dict[str, Any]) -> torch.Tensor:
        size = _itemsize(info["dtype"])
        numel = int(np.prod(info["shape"], dtype=np.int64)) if info["shape"] else 1
        buf = np.empty(numel, dtype=_NP_INT[size])
        with open(d / info["file"], "rb") as f:
            f.seek(info["offset"])
            got = f.readinto(memoryview(buf).cast("B")) if numel else 0
        if got != numel * size:
            raise PayloadError(f"local checkpoint {d / info['file']} is truncated")
        return torch.from_numpy(buf).view(dtype_from_name(info["dtype"])).reshape(info["shape"])

    def verify(self) -> list[str]:
        """Names whose bytes do not match the digest recorded for the current version."""
        d, s = self.data_dir(), self.state()
        if d is None or s is None:
            return ["<no checkpoint>"]
        def ok(item: tuple[str, dict[str, Any]]) -> bool:
            n, info = item
            try:
                return tensor_digest(n, self.read_tensor(d, info)) == info["digest"]
            except PayloadError:
                return False
        items = list(s["tensors"].items())
        return [n for (n, _), good in zip(items, map_threads(ok, items)) if not good]

    # -- installing a full version ----------------------------------------------------------
    def install_full(self, version: int, shards: dict[str, bytes], digests: dict[str, str]) -> None:
        """Make a fresh data directory from full shards (already checked), then swap `model`."""
        new = self.path / f"data-{uuid.uuid4().hex[:12]}"
        new.mkdir()
        tensors: dict[str, Any] = {}
        for fname, data in shards.items():
            write_file(new / fname, data, self.fsync)
            for n, info in tensor_offsets(new / fname).items():
                tensors[n] = {**info, "file": fname, "digest": digests[n]}
        missing = set(digests) - set(tensors)
        if missing:
            shutil.rmtree(new, ignore_errors=True)
            raise PayloadError(f"full version {version} lacks tensors {sorted(missing)[:5]}")
        atomic_write(new / "state.json", json.dumps({"version": version, "tensors": tensors}).encode(),
                     self.fsync)
        link = self.path / f".model-{uuid.uuid4().hex[:8]}"
        os.symlink(new.name, link)
        os.replace(link, self.model_dir)           # the commit point
        if self.fsync:
            fsync_dir(self.path)
        self.recover()                              # drops the old data directory

    # -- applying a delta in place ----------------------------------------------------------
    def apply_changes(self, version: int, changes: dict[str, Change], digests: dict[str, str]) -> None:
        """Journal the changes (positions as compact as the delta had them, new values), then
        write them in place, keeping the values they replace in memory, then check every changed
        tensor's digest on the written bytes, then state."""
        d, s = self.data_dir(), self.state()
        if d is None or s is None:
            raise PayloadError("the local checkpoint holds no version to apply a delta to")
        for n in changes:
            if n not in s["tensors"]:
                raise PayloadError(f"tensor {n!r} is not in the local checkpoint")
        arrays: dict[str, torch.Tensor] = {}
        forms: dict[str, str] = {}
        for n, c in changes.items():
            if c.idx is None:
                arrays[n + "::full"] = c.vals.contiguous()
                continue
            forms[n] = c.form
            arrays.update({n + "::" + k: a.contiguous() for k, a in c.stored.items()})
            arrays[n + "::val"] = c.vals.contiguous()
        new_state = {"version": version,
                     "tensors": {n: {**info, "digest": digests.get(n, info["digest"])}
                                 for n, info in s["tensors"].items()}}
        tmp = d / f".journal-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        save_file(arrays, str(tmp / "changes.safetensors"))
        write_file(tmp / "journal.json", json.dumps({"old": s, "new": new_state, "pos": forms}).encode(),
                   self.fsync)
        if self.fsync:
            with open(tmp / "changes.safetensors", "rb+") as f:
                os.fsync(f.fileno())
            fsync_dir(tmp)
        os.rename(tmp, d / "journal")               # the commit point
        if self.fsync:
            fsync_dir(d)
        self._redo(d, changes)

    def _redo(self, d: Path, changes: dict[str, Change] | None = None) -> None:
        """Write a committed journal into the data files (idempotent), check the digest of every
        tensor it touched on the bytes now in the file, move state, drop the journal.

        A digest that does not match: the replaced values go back and the old version stays
        current. They are known when this process wrote the journal (kept in memory while
        writing) or when the journal holds them (older releases wrote them); after a crash they
        are not, and the data directory is discarded. So it is too when the old bytes do not
        match the old digests either: they were damaged before this delta. Without state, the
        next sync installs the newest full version."""
        j = d / "journal"
        journal = json.loads((j / "journal.json").read_bytes())
        if "new" not in journal:        # an older release's journal: new values only, no undo
            journal = {"old": None, "new": journal}
        old_state, new_state = journal["old"], journal["new"]
        v_old, v_new = (old_state or {}).get("version"), new_state["version"]
        if changes is None:                         # a replay: only the journal knows the values
            changes, undo = _journal_changes(journal, new_state, j / "changes.safetensors")
            can_undo = old_state is not None and set(undo) == set(changes)
            capture = None
        else:
            undo = capture = {}                     # filled by the write below
            can_undo = True
        bad = self._write(d, changes, new_state, capture)
        if bad:
            still = bad if not can_undo else self._write(
                d, {n: Change(changes[n].idx, undo[n]) for n in changes}, old_state, None)
            if still:
                (d / "state.json").unlink(missing_ok=True)
                why = (f"tensors {still[:5]} differ from their digests" if can_undo else
                       "the values it replaced are not known after a crash")
                what = (f"the local checkpoint cannot be brought back to version {v_old} ({why}); "
                        f"it was discarded and the newest full version will be installed")
            else:
                what = f"the delta was not applied; the local checkpoint stays at version {v_old}"
            self._drop_journal(d)
            raise PayloadError(f"version {v_new}: tensors {bad[:5]} do not match their digests "
                               f"after the delta was written; {what}")
        atomic_write(d / "state.json", json.dumps(new_state).encode(), self.fsync)
        self._drop_journal(d)

    def _write(self, d: Path, changes: dict[str, Change], state: dict[str, Any],
               undo: dict[str, torch.Tensor] | None) -> list[str]:
        """Write `changes` into the data files, hashing each changed tensor as it goes; returns
        the names whose bytes then differ from `state`'s digests. `undo`, when given, receives
        the values each write replaced."""
        names = sorted(changes)
        files = sorted({state["tensors"][n]["file"] for n in names})
        maps = [map_file(d / f) for f in files]       # every file at once: one pass over all tensors
        bufs = {f: buf for f, (_, buf) in zip(files, maps)}
        try:
            def write_and_check(n: str) -> bool:
                info = state["tensors"][n]
                c = changes[n]
                region = _region(bufs[info["file"]], info)
                view = region.view(dtype_from_name(info["dtype"])).reshape(info["shape"])
                h = Digest(tensor_header(n, view))
                if c.idx is None:
                    if undo is not None:
                        undo[n] = region.clone()
                    region.copy_(c.vals.reshape(-1).view(region.dtype))
                    h.update(memoryview(region.numpy()).cast("B"))
                else:
                    old = kernels.swap(region, c.idx, c.vals.view(region.dtype), h)
                    if undo is not None:
                        undo[n] = old
                return h.hexdigest() == info["digest"]
            bad = [n for n, ok in zip(names, map_threads(write_and_check, names)) if not ok]
            if self.fsync:
                for mm, _ in maps:
                    mm.flush()
            return bad
        finally:
            bufs.clear()
            unmap_later(maps)

    @staticmethod
    def _drop_journal(d: Path) -> None:
        done = d / f".journal-done-{uuid.uuid4().hex[:8]}"
        os.rename(d / "journal", done)
        shutil.rmtree(done, ignore_errors=True)


def map_file(path: Path) -> tuple[mmap.mmap, torch.Tensor]:
    """A file's bytes as a writable uint8 tensor over a shared mapping (writes go to the page
    cache, the same pages the engine reads), with the mapping itself."""
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def unmap_later(maps: list[tuple[mmap.mmap, torch.Tensor]]) -> threading.Thread:
    """Unmap on a thread of its own: unmapping a written GiB costs about 15 ms (page tables, TLB)
    that nothing has to wait for, the written pages stay in the page cache. Takes the caller's
    list, so the caller holds no view that would keep a mapping alive."""
    def close() -> None:
        while maps:
            mm, buf = maps.pop()
            del buf
            try:
                mm.close()
            except BufferError:       # a view is still alive somewhere; the GC unmaps it
                pass
    t = threading.Thread(target=close, name="weightsync-unmap", daemon=True)
    t.start()
    return t


def _region(buf: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
    """One tensor's bytes inside a mapped file, as a flat integer view."""
    size = _itemsize(info["dtype"])
    numel = int(np.prod(info["shape"], dtype=np.int64)) if info["shape"] else 1
    off = int(info["offset"])
    region = buf[off: off + numel * size]
    if region.numel() != numel * size:
        raise PayloadError(f"local checkpoint: tensor at offset {off} runs past the end of its file")
    if off % size:
        raise PayloadError(f"local checkpoint: tensor at offset {off} is not aligned to {size} bytes")
    return region.view(_TORCH_INT[size])


@dataclass
class Change:
    """What a delta does to one tensor of the local checkpoint."""
    idx: torch.Tensor | None                 # validated int64 positions (None: `vals` is whole)
    vals: torch.Tensor                       # the new values as integer bits, or the whole tensor
    stored: dict[str, torch.Tensor] = field(default_factory=dict)  # positions as journalled
    form: str = "idx"                        # their positions.py form

    @classmethod
    def of(cls, idx: torch.Tensor | None, vals: torch.Tensor, numel: int,
           stored: tuple[str, dict[str, torch.Tensor]] | None = None) -> Change:
        """A change; its positions are gap-coded for the journal unless `stored` has them."""
        if idx is None:
            return cls(None, vals)
        form, arrays = stored or positions.encode(idx, numel)
        return cls(idx, vals, arrays, form)


def _journal_changes(journal: dict[str, Any], state: dict[str, Any], path: Path
                     ) -> tuple[dict[str, Change], dict[str, torch.Tensor]]:
    """A committed journal's changes (positions decoded and validated) and the replaced values
    it holds (only older releases wrote them)."""
    arrays = dict(unpack(bytearray(path.read_bytes()))[0])
    forms = journal.get("pos", {})
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, a in arrays.items():
        n, _, suffix = key.rpartition("::")
        parts.setdefault(n, {})[suffix] = a
    changes: dict[str, Change] = {}
    undo: dict[str, torch.Tensor] = {}
    for n, ps in parts.items():
        info = state["tensors"][n]
        if "old" in ps:
            undo[n] = ps.pop("old")
        if "full" in ps:
            changes[n] = Change(None, ps["full"])
            continue
        numel = int(np.prod(info["shape"], dtype=np.int64)) if info["shape"] else 1
        vals = ps.pop("val")
        form = forms.get(n, "idx")
        idx = positions.decode(n, form, ps, vals.numel(), numel)
        changes[n] = Change(idx, vals, ps, form)
    return changes, undo
