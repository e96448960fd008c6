"""The host-local checkpoint a pull agent keeps and its engines reload from.

    LOCAL/.lock                 flock: exclusive to change, shared while an engine reads
    LOCAL/model -> data-<id>    symlink, swapped atomically (a fresh full copy)
    LOCAL/data-<id>/*.safetensors, state.json {"version", "tensors": {name: file, offset, digest}}
    LOCAL/data-<id>/journal/    a committed redo journal (changes.safetensors + journal.json)

A delta is applied in place, through a redo journal: the changed positions and their new values
are written and flushed under a temporary name, renamed to `journal` (the commit point), written
into the data files, then state.json moves to the new version and the journal is dropped.
`open()` replays a committed journal and deletes anything half-made, so after a crash at any
moment the checkpoint holds one whole version: the old one, or the new one."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import save_file

from weightsync.bucket import digest_tensors, dtype_from_name
from weightsync.errors import PayloadError
from weightsync.wire import unpack

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
    def locked(self, exclusive: bool = True) -> Iterator["LocalCheckpoint"]:
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
            self._redo(d)

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

    def digest_patched(self, d: Path, name: str, info: dict[str, Any], idx: torch.Tensor,
                       vals: torch.Tensor) -> str:
        """The digest the tensor would have with `vals` (integer bits) at ascending positions
        `idx`, streamed through a small buffer: checks a sparse delta without materializing the
        tensor or writing anything."""
        import xxhash

        size = _itemsize(info["dtype"])
        numel = int(np.prod(info["shape"], dtype=np.int64)) if info["shape"] else 1
        h = xxhash.xxh3_128()
        h.update(f"{name}|{info['dtype']}|{list(info['shape'])}\n".encode())
        pos_np, vals_np = idx.numpy(), vals.numpy()
        buf = np.empty(min(numel, 1 << 21), dtype=_NP_INT[size])
        j = 0
        with open(d / info["file"], "rb") as f:
            f.seek(info["offset"])
            pos = 0
            while pos < numel:
                n = min(len(buf), numel - pos)
                view = buf[:n]
                if f.readinto(memoryview(view).cast("B")) != n * size:
                    raise PayloadError(f"local checkpoint {d / info['file']} is truncated")
                k = int(np.searchsorted(pos_np, pos + n, side="left"))
                if k > j:
                    view[pos_np[j:k] - pos] = vals_np[j:k]
                    j = k
                h.update(view)
                pos += n
        return h.hexdigest()

    def verify(self) -> list[str]:
        """Names whose bytes do not match the digest recorded for the current version."""
        d, s = self.data_dir(), self.state()
        if d is None or s is None:
            return ["<no checkpoint>"]
        bad = []
        for n, info in s["tensors"].items():
            try:
                if digest_tensors([(n, self.read_tensor(d, info))]) != info["digest"]:
                    bad.append(n)
            except PayloadError:
                bad.append(n)
        return bad

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
    def apply_changes(self, version: int, changes: dict[str, tuple[torch.Tensor | None, torch.Tensor]],
                      digests: dict[str, str]) -> None:
        """`changes`: name -> (int64 positions, new values as their integer bits) or
        (None, whole new tensor). Journal first, then in place, then state."""
        d, s = self.data_dir(), self.state()
        if d is None or s is None:
            raise PayloadError("the local checkpoint holds no version to apply a delta to")
        arrays: dict[str, torch.Tensor] = {}
        for n, (idx, vals) in changes.items():
            if n not in s["tensors"]:
                raise PayloadError(f"tensor {n!r} is not in the local checkpoint")
            if idx is None:
                arrays[n + "::full"] = vals.contiguous()
            else:
                small = int(np.prod(s["tensors"][n]["shape"], dtype=np.int64)) < 2**31
                arrays[n + "::idx"] = idx.to(torch.int32 if small else torch.int64).contiguous()
                arrays[n + "::val"] = vals.contiguous()
        new_state = {"version": version,
                     "tensors": {n: {**info, "digest": digests.get(n, info["digest"])}
                                 for n, info in s["tensors"].items()}}
        tmp = d / f".journal-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        save_file(arrays, str(tmp / "changes.safetensors"))
        write_file(tmp / "journal.json", json.dumps(new_state).encode(), self.fsync)
        if self.fsync:
            with open(tmp / "changes.safetensors", "rb+") as f:
                os.fsync(f.fileno())
            fsync_dir(tmp)
        os.rename(tmp, d / "journal")               # the commit point
        if self.fsync:
            fsync_dir(d)
        self._redo(d)

    def _redo(self, d: Path) -> None:
        """Write a committed journal into the data files (idempotent), move state, drop it."""
        j = d / "journal"
        new_state = json.loads((j / "journal.json").read_bytes())
        named, _ = unpack(bytearray((j / "changes.safetensors").read_bytes()))
        arrays = dict(named)
        by_file: dict[str, list[str]] = {}
        for key in arrays:
            n = key.rsplit("::", 1)[0]
            by_file.setdefault(new_state["tensors"][n]["file"], []).append(n)
        for fname, names in by_file.items():
            mm = np.memmap(d / fname, dtype=np.uint8, mode="r+")
            for n in set(names):
                info = new_state["tensors"][n]
                size = _itemsize(info["dtype"])
                numel = int(np.prod(info["shape"], dtype=np.int64)) if info["shape"] else 1
                region = mm[info["offset"]: info["offset"] + numel * size].view(_NP_INT[size])
                if n + "::full" in arrays:
                    region[:] = arrays[n + "::full"].reshape(-1).view(_TORCH_INT[size]).numpy()
                else:
                    region[arrays[n + "::idx"].numpy()] = arrays[n + "::val"].view(_TORCH_INT[size]).numpy()
            if self.fsync:
                mm.flush()
            del mm
        atomic_write(d / "state.json", json.dumps(new_state).encode(), self.fsync)
        done = d / f".journal-done-{uuid.uuid4().hex[:8]}"
        os.rename(j, done)
        shutil.rmtree(done, ignore_errors=True)
