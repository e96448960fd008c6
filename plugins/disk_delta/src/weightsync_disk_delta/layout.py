"""The published layout, shared by the writer (transport) and the readers (agents):

    ROOT/latest                         {"version": v, "dir": "versions/v00000012"}   (atomic)
    ROOT/versions/v00000012/manifest.json
    ROOT/versions/v00000012/shard-00000.safetensors ...
    ROOT/versions/.tmp-*                being written; readers never look inside
    ROOT/versions/.trash-*              retired, being deleted
    ROOT/.publisher.lock                flock of the one publisher of this root

Everything is written under a temporary name, flushed, then renamed. Hooks ("module:function",
called with the path) let users make non-POSIX mounts coherent: `after_write` once a file or
directory is durable, `before_read` before a reader looks at one.

Readers trust nothing here: files are opened below the root without following links, only
regular files of the size the manifest says are read (safeio), and every JSON file is validated
against its schema (schema) before anything it names is opened."""

from __future__ import annotations

import json

import importlib
import os
import re
import socket
import uuid
from pathlib import Path
from typing import Callable

import xxhash
from pydantic import ValidationError

from weightsync.errors import PayloadError

from .safeio import Missing, hash_regular, list_dir, read_regular, stat_regular
from .schema import MANIFEST_FORMAT, READABLE_FORMATS, LatestPointer, Manifest, ShardEntry, explain

__all__ = ["MANIFEST_FORMAT", "READABLE_FORMATS", "LATEST", "VERSIONS", "Hook", "load_hook",
           "version_dir_name", "parse_version_dir", "file_digest", "fsync_dir", "write_file",
           "atomic_write", "unique_tag", "read_latest", "list_versions", "read_manifest",
           "read_shard", "stat_shard", "check_shard"]

LATEST = "latest"
VERSIONS = "versions"
MAX_LATEST_BYTES = 4096
MAX_MANIFEST_BYTES = 256 << 20       # ~1M tensors' entries; a manifest is never read past this
_VDIR = re.compile(r"v(\d{8,})")

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


def file_digest(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def unique_tag() -> str:
    """host-pid-random: a temporary name no other process, on this host or another one sharing
    the filesystem, picks at the same time."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes | bytearray | memoryview, fsync: bool = True) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def atomic_write(path: Path, data: bytes, fsync: bool = True) -> None:
    """Write under a temporary name in the same directory, flush, rename over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{unique_tag()}")
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
        raw = read_regular(root, [LATEST], limit=MAX_LATEST_BYTES)
    except Missing:
        return None
    except PayloadError as e:
        raise PayloadError(f"{e}; the publisher rewrites `latest` with its next version") from None
    try:
        return LatestPointer.model_validate_json(raw).version
    except ValidationError as e:
        raise PayloadError(f"{p} is not a valid latest pointer ({explain(e)}); the publisher "
                           f"rewrites it with its next version") from None


def list_versions(root: Path) -> list[int]:
    return sorted(v for n in list_dir(root, [VERSIONS]) if (v := parse_version_dir(n)) is not None)


def manifest_signature(key: bytes, raw: dict) -> str:
    """HMAC-SHA256 over the manifest's canonical JSON without its `sig` (weightsync.wire.signing's
    shared key): a forged version on the shared root fails to verify."""
    import hashlib
    import hmac
    body = json.dumps({k: v for k, v in raw.items() if k != "sig"}, sort_keys=True,
                      separators=(",", ":")).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def check_signature(key: bytes | None, version: int, raw: bytes | bytearray) -> None:
    """With a key, the manifest must carry a valid `sig`; PayloadError otherwise."""
    if key is None:
        return
    import hmac
    try:
        data = json.loads(raw)
    except ValueError:
        return                           # the schema check says what is wrong with it
    got = data.get("sig") if isinstance(data, dict) else None
    if not isinstance(got, str) or not hmac.compare_digest(got, manifest_signature(key, data)):
        what = "is not signed" if got is None else "has a wrong signature"
        raise PayloadError(f"version {version}: the manifest {what}: it was not published by a "
                           f"trainer holding this host's HMAC key (a forged version, or the "
                           f"publisher lacks sync.hmac_key_file); nothing was applied")


def read_manifest(root: Path, version: int, before_read: Hook | None = None,
                  key: bytes | None = None) -> Manifest:
    """The manifest of `version`, validated against the schema (types, names, shard file
    names, kinds, sizes) and, with `key`, its signature; PayloadError when missing, not a regular
    file, malformed or not signed with the key."""
    d = root / VERSIONS / version_dir_name(version)
    p = d / "manifest.json"
    if before_read:
        before_read(str(d))
    try:
        raw = read_regular(root, [VERSIONS, version_dir_name(version), "manifest.json"],
                           limit=MAX_MANIFEST_BYTES)
    except PayloadError as e:
        raise type(e)(f"version {version}: {e}") from None
    check_signature(key, version, raw)
    try:
        m = Manifest.model_validate_json(raw)
    except ValidationError as e:
        raise PayloadError(f"version {version}: {p} does not follow the manifest schema: "
                           f"{explain(e)}") from None
    if m.version != version:
        raise PayloadError(f"version {version}: {p} says it is version {m.version}")
    return m


def shard_parts(version: int, shard: ShardEntry) -> list[str]:
    return [VERSIONS, version_dir_name(version), shard.file]


def stat_shard(root: Path, version: int, shard: ShardEntry) -> None:
    """Check that a shard is a regular file under the root of the size the manifest says."""
    try:
        size = stat_regular(root, shard_parts(version, shard))
    except PayloadError as e:
        raise type(e)(f"version {version}: {e}") from None
    if size != shard.bytes:
        raise PayloadError(f"version {version}: shard {shard.file} holds {size} bytes, the "
                           f"manifest says {shard.bytes}")


def check_shard(root: Path, version: int, shard: ShardEntry) -> None:
    """Check a shard's size and xxh3-128 against the manifest without keeping its bytes."""
    try:
        got = hash_regular(root, shard_parts(version, shard), shard.bytes)
    except PayloadError as e:
        raise type(e)(f"version {version}: {e}") from None
    if got != shard.xxh3:
        raise PayloadError(f"version {version}: shard {root / VERSIONS / version_dir_name(version) / shard.file} "
                           f"is corrupted (digest {got}; the manifest says {shard.xxh3}); nothing "
                           f"was applied")


def read_shard(root: Path, version: int, shard: ShardEntry) -> bytearray:
    """A shard's bytes after checking its size (before reading) and xxh3-128 against the
    manifest."""
    p = root / VERSIONS / version_dir_name(version) / shard.file
    try:
        data = read_regular(root, shard_parts(version, shard), limit=shard.bytes, exact=shard.bytes)
    except PayloadError as e:
        raise type(e)(f"version {version}: {e}") from None
    got = file_digest(data)
    if got != shard.xxh3:
        raise PayloadError(f"version {version}: shard {p} is corrupted ({len(data)} bytes, digest "
                           f"{got}; the manifest says {shard.bytes} bytes, {shard.xxh3}); it was "
                           f"not applied")
    return data
