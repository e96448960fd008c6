"""The host-local checkpoint a pull agent keeps and its engines reload from.

    LOCAL/.lock                 flock: exclusive to change, shared while an engine reads
    LOCAL/model -> data-<id>    symlink, swapped atomically (a fresh full copy)
    LOCAL/data-<id>/*.safetensors, state.json {"version", "tensors": {name: file, offset, digest}}
    LOCAL/data-<id>/journal/    a committed redo journal (journal.py)

A delta is applied in place, through a journal: the changes are checked against the local
tensors, journalled and renamed into place (the commit point), written into the data files while
the values they replace are kept in memory, and each changed tensor's digest is checked on the
bytes now in the file; then state.json moves to the new version and the journal is dropped.
A digest that does not match, or any error while writing, puts the old values back (recorded in
the journal first, so a crash meanwhile is finished by the next replay): the old version stays.

A full version is built in a fresh data directory (with any deltas after it) and becomes current
only when `model` is swapped to it, so the checkpoint moves from one whole version to another in
one step. `recover()` replays a committed journal and deletes anything half-made, so after a
crash at any moment the checkpoint holds one whole version, old or new. A copy that cannot be
brought back to a whole version is discarded as a whole (`model` removed first), never left
mixed; the agent then installs the newest full version."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from pydantic import ValidationError

from weightsync.wire.bucket import dtype_from_name, tensor_digest
from weightsync.errors import PayloadError
from weightsync.wire.pool import map_threads

from . import journal
from .change import Change, check_changes
from .layout import atomic_write, fsync_dir, write_file
from .mapped import map_file, unmap_later, write_changes
from .schema import ITEMSIZE, LocalState, numel_of

__all__ = ["LocalCheckpoint", "Build", "Change", "Undone", "map_file", "unmap_later",
           "tensor_offsets"]

log = logging.getLogger("weightsync.disk_delta.local")
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


class Undone(PayloadError):
    """A delta was written and then taken back: the old version stays current, or, when even
    that failed, the copy was discarded (`version` is then None)."""


def tensor_offsets(path: Path) -> dict[str, dict[str, Any]]:
    """name -> {offset (absolute, in bytes), dtype, shape} of a safetensors file (reads only its
    header; for files this host wrote or checked)."""
    from weightsync.wire.frame import SAFETENSORS_DTYPES, read_file_header
    start, header, _ = read_file_header(path)
    return {n: {"offset": start + int(info["data_offsets"][0]), "dtype": SAFETENSORS_DTYPES[info["dtype"]],
                "shape": [int(d) for d in info["shape"]]} for n, info in header.items()}


class LocalCheckpoint:
    def __init__(self, path: str | Path, fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.path.mkdir(parents=True, exist_ok=True)

    # -- locking ----------------------------------------------------------------------------
    @contextmanager
    def locked(self, exclusive: bool = True) -> Iterator[LocalCheckpoint]:
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
        return d if d.is_dir() and d.parent == self.path else None

    def state(self) -> dict[str, Any] | None:
        """The current version's state (validated), or None when there is no whole version."""
        d = self.data_dir()
        if d is None:
            return None
        try:
            return LocalState.model_validate_json((d / "state.json").read_bytes()).model_dump()
        except (OSError, ValidationError):
            return None

    @property
    def version(self) -> int | None:
        s = self.state()
        return None if s is None else int(s["version"])

    def recover(self) -> None:
        """Finish or undo whatever a crashed writer left (call under the exclusive lock)."""
        d = self.data_dir()
        for p in self.path.iterdir():          # unfinished copies, swapped-out data, temp links
            if p.name.startswith((".model", "data-")) and (d is None or p.name != d.name):
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
        if (d / journal.JOURNAL).is_dir():
            try:
                self._replay(d)
            except Exception as e:  # noqa: BLE001 - whatever a replay meets, the copy goes
                log.warning("the local checkpoint's journal could not be finished (%s); the copy "
                            "was discarded and the newest full version will be installed", e)
                self.discard()

    def discard(self) -> None:
        """Remove the current copy as a whole: `model` first (one step: no version, nothing an
        engine could load), then its data. The agent then installs the newest full version."""
        d = self.data_dir()
        self.model_dir.unlink(missing_ok=True)
        if self.fsync:
            fsync_dir(self.path)
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the current version (copies), for checks and tests."""
        d, s = self.data_dir(), self.state()
        if d is None or s is None:
            return {}
        return {n: self.read_tensor(d, info) for n, info in s["tensors"].items()}

    def read_tensor(self, d: Path, info: Mapping[str, Any]) -> torch.Tensor:
        size = ITEMSIZE[info["dtype"]]
        numel = numel_of(info["shape"])
        buf = np.empty(numel, dtype=_NP_INT[size])
        with open(d / info["file"], "rb") as f:
            f.seek(info["offset"])
            # numpy's stubs give ndarray __buffer__ only on Python 3.12+
            got = f.readinto(memoryview(buf).cast("B")) if numel else 0  # type: ignore[arg-type]
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
            except (OSError, PayloadError):
                return False
        items = list(s["tensors"].items())
        return [n for (n, _), good in zip(items, map_threads(ok, items)) if not good]

    # -- a full version, built aside -------------------------------------------------------
    def build(self, version: int, shards: Mapping[str, bytearray],
              layout: Mapping[str, Mapping[str, Any]], digests: Mapping[str, str]) -> Build:
        """A fresh data directory holding a full version: `shards` (checked, file -> bytes) as
        its data files, `layout` their tensors (name -> file, offset, dtype, shape)."""
        b = Build(self, self.path / f"data-{uuid.uuid4().hex[:12]}", version)
        b.dir.mkdir()
        try:
            for fname, data in shards.items():
                write_file(b.dir / fname, data, self.fsync)
            b.tensors = {n: {**dict(info), "digest": digests[n]} for n, info in layout.items()}
        except BaseException:
            b.discard()
            raise
        return b

    # -- a delta, in place ------------------------------------------------------------------
    def apply_changes(self, version: int, changes: dict[str, Change], digests: Mapping[str, str]) -> None:
        """Check the changes against the local tensors, journal them, write them in place
        (keeping the values they replace), check every changed tensor's digest on the written
        bytes, then move state. Any failure puts the old values back."""
        d, s = self.data_dir(), self.state()
        if d is None or s is None:
            raise PayloadError("the local checkpoint holds no version to apply a delta to")
        check_changes(changes, s["tensors"], version)               # before the journal
        new = {"version": version,
               "tensors": {n: {**info, "digest": digests.get(n, info["digest"])}
                           for n, info in s["tensors"].items()}}
        journal.commit(d, changes, s, new, self.fsync)
        self._forward(d, journal.Journal(s, new, changes, None), live=True)

    def _forward(self, d: Path, j: journal.Journal, live: bool) -> None:
        """Write a committed journal's new values (idempotent), check them, move state, drop
        the journal. `live`: this process wrote the journal and keeps the replaced values."""
        replaced: dict[str, torch.Tensor] | None = {} if live else None
        try:
            bad = write_changes(d, j.changes, j.new, replaced, self.fsync)
        except Exception as e:  # noqa: BLE001 - every error is undone, then reported
            if replaced is None:
                raise
            self._undo(d, j, replaced, f"writing it failed ({type(e).__name__}: {e})")
        if bad:
            if replaced is None:
                replaced = j.undo                   # a first-format journal holds them
            if replaced is None:
                self.discard()
                raise Undone(f"version {j.new['version']}: tensors {bad[:5]} do not match their "
                             f"digests after a replay, and the values it replaced are not known "
                             f"after a crash; the local copy was discarded and the newest full "
                             f"version will be installed")
            self._undo(d, j, replaced, f"tensors {bad[:5]} do not match their digests after the "
                                       f"delta was written")
        atomic_write(d / "state.json", json.dumps(j.new).encode(), self.fsync)
        journal.drop(d)

    def _undo(self, d: Path, j: journal.Journal, replaced: dict[str, torch.Tensor], why: str) -> None:
        """Put the replaced values back (recorded in the journal first, so a crash meanwhile is
        finished by the next replay), check them against the old version's digests, drop the
        journal. Always raises Undone, saying what happened. Tensors without replaced values
        were never written."""
        back = {n: Change(j.changes[n].idx, replaced[n]) for n in j.changes if n in replaced}
        try:
            journal.save_undo(d, {n: c.vals for n, c in back.items()}, self.fsync)
        except OSError as e:       # a full disk: put them back all the same
            log.warning("the undo record could not be written (%s)", e)
        self._restore(d, j, back, why)

    def _restore(self, d: Path, j: journal.Journal, back: dict[str, Change], why: str) -> None:
        """Write `back` (old values) and check every changed tensor against the old state;
        discard the copy when that fails. Raises Undone either way."""
        v_old, v_new = None if j.old is None else j.old["version"], j.new["version"]
        try:
            if j.old is None:
                still = ["<the old state is not known>"]
            else:       # what was put back, and what (no replaced values) was never written
                still = write_changes(d, back, j.old, None, self.fsync) + \
                    [n for n in sorted(set(j.changes) - set(back)) if not self._matches(d, n, j.old)]
        except Exception as e:  # noqa: BLE001 - the copy cannot be trusted any more
            still = [f"<{type(e).__name__}: {e}>"]
        if still:
            self.discard()
            raise Undone(f"version {v_new}: {why}; the local checkpoint could not be brought back "
                         f"to version {v_old} (tensors {still[:5]} differ from their digests: the "
                         f"local copy was damaged before), so it was discarded and the newest "
                         f"full version will be installed")
        journal.drop(d)
        raise Undone(f"version {v_new}: {why}; the delta was not applied and the local "
                     f"checkpoint stays at version {v_old}")

    def _matches(self, d: Path, name: str, state: Mapping[str, Any]) -> bool:
        info = state["tensors"][name]
        return tensor_digest(name, self.read_tensor(d, info)) == info["digest"]

    def _replay(self, d: Path) -> None:
        """Finish a committed journal after a crash: put the old values back when an undo was
        under way, else write the new ones (undone when they fail their digests and the old
        ones are known, else the copy is discarded)."""
        j = journal.load(d)
        try:
            if j.undoing:
                assert j.undo is not None
                back = {n: Change(c.idx, j.undo[n]) for n, c in j.changes.items()}
                self._restore(d, j, back, "a crash interrupted putting the old values back")
            self._forward(d, j, live=False)
        except Undone as e:
            log.warning("%s", e)       # finished: the old version stays, or the copy is gone


class Build:
    """A version being made in a fresh data directory next to the current one: nothing reads it
    until `commit` swaps `model` to it, and a crash before that leaves it to the next
    `recover()`, which removes it."""

    def __init__(self, lc: LocalCheckpoint, d: Path, version: int) -> None:
        self.lc, self.dir, self.version = lc, d, version
        self.tensors: dict[str, dict[str, Any]] = {}
        self.committed = False

    @property
    def state(self) -> dict[str, Any]:
        return {"version": self.version, "tensors": self.tensors}

    def apply(self, version: int, changes: dict[str, Change], digests: Mapping[str, str]) -> None:
        """Write a delta straight into the new copy (no journal: a failure discards the copy)."""
        check_changes(changes, self.tensors, version)
        new = {n: {**info, "digest": digests.get(n, info["digest"])} for n, info in self.tensors.items()}
        bad = write_changes(self.dir, changes, {"tensors": new}, None, self.lc.fsync)
        if bad:
            raise PayloadError(f"version {version}: tensors {bad[:5]} do not match their digests "
                               f"after the delta was written")
        self.tensors, self.version = new, version

    def commit(self) -> None:
        """Write state, swap `model` to the new copy (the commit point), drop the old one."""
        atomic_write(self.dir / "state.json", json.dumps(self.state).encode(), self.lc.fsync)
        if self.lc.fsync:
            fsync_dir(self.dir)
        link = self.lc.path / f".model-{uuid.uuid4().hex[:8]}"
        os.symlink(self.dir.name, link)
        os.replace(link, self.lc.model_dir)           # the commit point
        self.committed = True
        if self.lc.fsync:
            fsync_dir(self.lc.path)
        self.lc.recover()                             # drops the old data directory

    def discard(self) -> None:
        """Remove the new copy, unless it already became the current one."""
        if not self.committed:
            shutil.rmtree(self.dir, ignore_errors=True)
