"""Transport `disk_delta`: publish-only. Each version becomes a directory of shards (one per
payload, each a safetensors file) plus `manifest.json`, written under a temporary name, flushed and
renamed; then the `latest` pointer moves atomically. Rollout hosts pull (see agent.py).

One publisher per root: the transport holds the root's lock (rootlock.py) from its first publish
until it is closed, so a second trainer is refused instead of deleting this one's temporary
directory. Temporary names carry host and pid. Under the lock, what crashed publishers left
(`.tmp-*`, and `.trash-*` of retired versions) is removed.

A failure at any point (unwritable root, full disk) removes the temporary directory and raises;
`latest` and every published version stay as they were."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from weightsync.wire.bucket import tensor_digest
from weightsync.errors import TransportError
from weightsync.interfaces import Adapter, Payload, ReloadsFromDisk, Transport
from weightsync.wire.signing import load_key
from weightsync.wire.frame import unpack

from .encoding import FORMAT as DELTA_FORMAT
from .layout import (LATEST, MANIFEST_FORMAT, manifest_signature, VERSIONS, atomic_write, file_digest, fsync_dir,
                     list_versions, load_hook, read_latest, read_manifest, unique_tag,
                     version_dir_name, write_file)
from .rootlock import LockHeld, PublisherLock


class DiskDeltaOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str = Field(description="the shared directory versions are published under")
    keep_full: int = Field(1, ge=1, description=(
        "full versions kept with their chains; older versions are deleted"))
    fsync: bool = Field(True, description="flush every file and directory before renaming")
    hmac_key_file: str | None = Field(None, description=(
        "sign every manifest with this shared key (also $WEIGHTSYNC_HMAC_KEY); agents holding "
        "the key refuse unsigned or forged versions"))
    after_write: str | None = Field(None, description=(
        "'module:function' called with each path once it is written (object-store coherence)"))


class DiskDeltaTransport(Transport):
    name = "disk_delta"
    Options = DiskDeltaOptions
    requires = (ReloadsFromDisk,)   # the pull agent has each engine reload its local copy
    publish_only = True
    receiver = None

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self.root = Path(self.options.root)
        self._after_write = load_hook(self.options.after_write)
        self._tmp: Path | None = None
        self._lock = PublisherLock(self.root)
        self._reset()

    def _reset(self) -> None:
        self._version: int | None = None
        self._latest: int | None = None
        self._kind: str | None = None
        self._base: int | None = None
        self._encoding: str | None = None
        self._tensors: dict[str, Any] = {}
        self._shards: list[dict[str, Any]] = []

    def _fail(self, what: str, e: BaseException) -> TransportError:
        self._discard()
        detail = f"{e.strerror} ({e.filename})" if isinstance(e, OSError) and e.strerror else str(e)
        hint = ""
        if isinstance(e, OSError) and e.errno == 28:
            hint = "; free space on that filesystem or lower `keep_full`"
        elif isinstance(e, OSError) and e.errno in (13, 30, 1):
            hint = "; make the root writable by this process or point `root` elsewhere"
        err = TransportError(f"disk_delta: {what} failed: {detail}; version {self._version} was not "
                             f"published and {self._latest_now()}{hint}")
        self._reset()
        return err

    def _latest_now(self) -> str:
        """What `latest` points at now (read again: the error must name what readers see)."""
        try:
            v = read_latest(self.root)
        except Exception:  # noqa: BLE001 - a broken pointer is named as such
            return f"{self.root / LATEST} cannot be read"
        return "nothing is published yet" if v is None else \
            f"`latest` still points at version {v}, which is intact"

    def _discard(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _hook(self, path: Path) -> None:
        if self._after_write:
            self._after_write(str(path))

    # -- one sync ---------------------------------------------------------------------------
    def open(self, engines: Sequence[Adapter], version: int) -> dict[str, BaseException]:
        self._discard()
        self._reset()
        self._version = version
        try:
            self._lock.acquire()
        except LockHeld as e:
            raise TransportError(f"disk_delta: {e}; version {version} was not published") from None
        except OSError as e:
            raise self._fail(f"locking {self.root}", e) from None
        try:
            self._latest = read_latest(self.root)
        except Exception as e:  # noqa: BLE001 - a corrupt pointer is overwritten by this publish
            self._latest = max(list_versions(self.root), default=None) if self.root.is_dir() else None
            if self._latest is None:
                raise self._fail(f"reading {self.root / LATEST}", e) from None
        if self._latest is not None and version <= self._latest:
            raise TransportError(f"disk_delta: version {version} is not above the published version "
                                 f"{self._latest} in {self.root}; push a higher version")
        try:
            (self.root / VERSIONS).mkdir(parents=True, exist_ok=True)
            self._sweep()
            self._tmp = self.root / VERSIONS / f".tmp-{version_dir_name(version)}-{unique_tag()}"
            self._tmp.mkdir()
        except OSError as e:
            raise self._fail(f"preparing {self.root}", e) from None
        return {}

    def _sweep(self) -> None:
        """Remove what crashed publishers left: temporary and retired directories (under the
        lock, none of them belongs to a live publisher)."""
        for stale in (self.root / VERSIONS).iterdir():
            if stale.name.startswith((".tmp-", ".trash-")) and stale != self._tmp:
                if stale.is_dir() and not stale.is_symlink():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)

    def _entries(self, payload: Payload) -> tuple[str, int | None, dict[str, Any]]:
        """(kind, base version, per-tensor entries) of one payload."""
        if payload.encoding == "delta":
            meta = payload.meta
            if meta.get("format") != DELTA_FORMAT:
                raise TransportError(f"disk_delta: payload {payload.index} has no delta metadata")
            return meta["kind"], meta.get("base_version"), meta["tensors"]
        if payload.encoding in ("raw", "cast"):
            named = dict(unpack(payload.body)[0])
            return "full", None, {s.name: {"kind": "full", "digest": tensor_digest(s.name, named[s.name])}
                                  for s in payload.specs}
        raise TransportError(f"disk_delta cannot publish encoding {payload.encoding!r}; use 'delta' "
                             f"(or 'raw'/'cast', which publish full versions)")

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        if self._tmp is None:
            raise TransportError("disk_delta: send() before open(); the pipeline opens each sync")
        kind, base, entries = self._entries(payload)
        if self._kind is None:
            self._kind, self._base, self._encoding = kind, base, payload.encoding
            if kind == "delta":
                self._check_base(base)
        elif (kind, base) != (self._kind, self._base):
            self._discard()
            raise TransportError(f"disk_delta: payload {payload.index} is {kind} against {base}, "
                                 f"the version's first payload was {self._kind} against {self._base}")
        shard = f"shard-{payload.index:05d}.safetensors"
        body = payload.body.cpu() if payload.body.device.type != "cpu" else payload.body
        # numpy's stubs give ndarray __buffer__ only on Python 3.12+
        data = (memoryview(body.numpy()).cast("B")  # type: ignore[arg-type]
                if body.numel() else memoryview(b""))
        try:
            write_file(self._tmp / shard, data, self.options.fsync)
        except OSError as e:
            raise self._fail(f"writing {shard} of version {self._version}", e) from None
        self._shards.append({"file": shard, "bytes": len(data), "xxh3": file_digest(data)})
        for s in payload.specs:
            ent = entries.get(s.name)
            if ent is None:
                self._discard()
                raise TransportError(f"disk_delta: tensor {s.name!r} has no entry in payload {payload.index}")
            self._tensors[s.name] = {**ent, "dtype": s.dtype, "shape": list(s.shape),
                                     "shard": shard}
        return {}

    def _check_base(self, base: int | None) -> None:
        if self._latest is None or not any(self._is_full(v) for v in list_versions(self.root)):
            self._discard()
            raise TransportError(
                f"disk_delta: {self.root} holds no full version, so a host that joins could not "
                f"start; the first published version must be full: leave the delta encoding's "
                f"`base_checkpoint` unset for a new root")
        if base != self._latest:
            self._discard()
            raise TransportError(
                f"disk_delta: this delta is against version {base}, but {self.root} publishes "
                f"version {self._latest} as latest; seed the delta encoding from version "
                f"{self._latest} (base_checkpoint, base_version) or start it without one so its "
                f"first version is full")

    def _is_full(self, v: int) -> bool:
        try:
            return read_manifest(self.root, v).kind == "full"
        except Exception:  # noqa: BLE001 - an unreadable version is no reader's base
            return False

    def finish(self, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        if self._tmp is None or self._version is None:
            raise TransportError("disk_delta: finish() without an open version")
        v = self._version
        final = self.root / VERSIONS / version_dir_name(v)
        if self._tensors and all(t["kind"] == "full" for t in self._tensors.values()):
            self._kind, self._base = "full", None      # every tensor shipped whole: a full version
        manifest = {"format": MANIFEST_FORMAT, "version": v, "kind": self._kind,
                    "base_version": self._base if self._kind == "delta" else None,
                    "encoding": self._encoding, "created": time.time(),
                    "wire_bytes": sum(s["bytes"] for s in self._shards),
                    "shards": self._shards, "tensors": self._tensors}
        key = load_key(None, self.options.hmac_key_file)
        if key is not None:
            manifest["sig"] = manifest_signature(key, json.loads(json.dumps(manifest)))
        try:
            write_file(self._tmp / "manifest.json", json.dumps(manifest, indent=1).encode(),
                       self.options.fsync)
            if self.options.fsync:
                fsync_dir(self._tmp)
            os.rename(self._tmp, final)
            self._tmp = None
            if self.options.fsync:
                fsync_dir(final.parent)
        except OSError as e:
            raise self._fail(f"writing the manifest of version {v}", e) from None
        self._hook(final)
        pointer = json.dumps({"version": v, "dir": f"{VERSIONS}/{version_dir_name(v)}"}).encode()
        try:
            atomic_write(self.root / LATEST, pointer, self.options.fsync)
        except OSError as e:
            shutil.rmtree(final, ignore_errors=True)     # never a version newer than `latest`
            raise self._fail(f"moving {self.root / LATEST} to version {v}", e) from None
        self._hook(self.root / LATEST)
        self._reset()
        self.retain()
        return {}

    def retain(self) -> list[int]:
        """Delete versions older than the `keep_full`-th newest full one (they are reachable
        from no full version a reader would start from). Returns the deleted versions."""
        versions = list_versions(self.root)
        fulls = []
        for v in reversed(versions):
            if self._is_full(v):
                fulls.append(v)
            if len(fulls) == self.options.keep_full:
                break
        if len(fulls) < self.options.keep_full:
            return []
        keep_from = fulls[-1]
        gone = []
        for v in versions:
            if v >= keep_from:
                break
            d = self.root / VERSIONS / version_dir_name(v)
            trash = self.root / VERSIONS / f".trash-{version_dir_name(v)}-{unique_tag()}"
            try:
                os.rename(d, trash)      # readers see the version whole or not at all
                shutil.rmtree(trash, ignore_errors=True)
                gone.append(v)
            except OSError:
                continue
        try:
            self._sweep()            # what rmtree could not remove now goes at the next publish
        except OSError:
            pass
        return gone

    def close(self) -> None:
        self._discard()
        self._lock.release()
