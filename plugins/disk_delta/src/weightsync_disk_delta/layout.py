"""The published layout, shared by the writer (transport) and the readers (agents):

    ROOT/latest                         {"version": v, "dir": "versions/v00000012"}   (atomic)
    ROOT/versions/v00000012/manifest.json
    ROOT/versions/v00000012/shard-00000.safetensors ...
    ROOT/versions/.tmp-*                being written; readers never look inside

Everything is written under a temporary name, flushed, then renamed. Hooks ("module:function",
called with the path) let users make non-POSIX mounts coherent: `after_write` once a file or
directory is durable, `before_read` before a reader looks at one."""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import xxhash

from weightsync.errors import PayloadError

MANIFEST_FORMAT = "weightsync-disk-delta/2"      # 2: sparse positions may be gap-coded ("pos")
READABLE_FORMATS = ("weightsync-disk-delta/1", MANIFEST_FORMAT)
LATEST = "latest"
VERSIONS = "versions"
_VDIR = re.compile(r"v(\d{8,})")
_SHARD = re.compile(r"shard-\d{5}\.safetensors")

Hook = Callable[[str], None]


def load_hook(spec: str | None) -> Hook | None:
    """'package.module:function' -> the function (called with one path)."""
    if not spec:
        return None
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise ValueError(f"hook {spec!r} must look like 'package.module:function'")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"hook {spec!r} cannot be loaded: {e}") from None


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


def parse_version_dir(name: str) -> int | None:
    m = _VDIR.fullmatch(name)
    return int(m.group(1)) if m else None


def file_digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes | memoryview, fsync: bool = True) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def atomic_write(path: Path, data: bytes, fsync: bool = True) -> None:
    """Write under a temporary name in the same directory, flush, rename over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_file(tmp, data, fsync)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def read_latest(root: Path, before_read: Hook | None = None) -> int | None:
    """The published version `latest` points at, or None when nothing is published yet."""
    p = root / LATEST
    if before_read:
        before_read(str(p))
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return None
    try:
        body = json.loads(raw)
        version = int(body["version"])
    except (ValueError, KeyError, TypeError) as e:
        raise PayloadError(f"{p} is not a valid latest pointer ({e}); the publisher rewrites it "
                           f"with the next version") from None
    if body.get("dir") != f"{VERSIONS}/{version_dir_name(version)}":
        raise PayloadError(f"{p} points at {body.get('dir')!r}, which does not match version {version}")
    return version


def list_versions(root: Path) -> list[int]:
    try:
        names = os.listdir(root / VERSIONS)
    except FileNotFoundError:
        return []
    return sorted(v for n in names if (v := parse_version_dir(n)) is not None)


def read_manifest(root: Path, version: int, before_read: Hook | None = None) -> dict[str, Any]:
    """The manifest of `version`, validated (names, shard file names, kinds); PayloadError when
    missing or malformed."""
    d = root / VERSIONS / version_dir_name(version)
    p = d / "manifest.json"
    if before_read:
        before_read(str(d))
    try:
        m = json.loads(p.read_bytes())
    except FileNotFoundError:
        raise PayloadError(f"version {version}: {p} is missing") from None
    except ValueError as e:
        raise PayloadError(f"version {version}: {p} is not valid JSON ({e})") from None
    try:
        if m["format"] not in READABLE_FORMATS or int(m["version"]) != version:
            raise PayloadError(f"version {version}: {p} has format {m.get('format')!r} and version "
                               f"{m.get('version')!r}")
        if m["kind"] not in ("full", "delta"):
            raise PayloadError(f"version {version}: unknown kind {m['kind']!r}")
        if m["kind"] == "delta" and not isinstance(m["base_version"], int):
            raise PayloadError(f"version {version}: a delta without a base version")
        shards = {s["file"] for s in m["shards"]}
        for s in m["shards"]:
            if not _SHARD.fullmatch(s["file"]):
                raise PayloadError(f"version {version}: shard file name {s['file']!r} is not allowed")
        for name, t in m["tensors"].items():
            if not isinstance(name, str) or not name or "/" in name or "\\" in name or ".." in name:
                raise PayloadError(f"version {version}: tensor name {name!r} is not allowed")
            if t["shard"] not in shards:
                raise PayloadError(f"version {version}: tensor {name!r} is in unknown shard {t['shard']!r}")
    except (KeyError, TypeError, AttributeError) as e:
        raise PayloadError(f"version {version}: {p} is malformed ({type(e).__name__}: {e})") from None
    return m


def read_shard(root: Path, version: int, shard: dict[str, Any]) -> bytes:
    """A shard's bytes after checking size and xxh3-128 against the manifest."""
    p = root / VERSIONS / version_dir_name(version) / shard["file"]
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise PayloadError(f"version {version}: shard {p} is missing") from None
    if len(data) != int(shard["bytes"]) or file_digest(data) != shard["xxh3"]:
        raise PayloadError(f"version {version}: shard {p} is corrupted ({len(data)} bytes, digest "
                           f"{file_digest(data)}; the manifest says {shard['bytes']} bytes, "
                           f"{shard['xxh3']}); it was not applied")
    return data
