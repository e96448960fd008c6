"""Signed payloads: an HMAC key shared by the trainer and the engines. xxh3 digests catch
corruption, not forgery: whoever can write to the network path can also recompute a digest. With
a key, every payload header carries `sig`, an HMAC-SHA256 over what the payload claims (version,
bucket index, last, encoding, digest, tensors); an engine that holds the key refuses a payload
whose signature is missing or wrong, and since its digest check binds the bytes to the signed
digest, forged bytes never reach a commit. The version is signed too, so a recorded payload
cannot be replayed into another version's round.

Keys come from `sync.hmac_key_file` / `$WEIGHTSYNC_HMAC_KEY` on the trainer and
`weightsync serve --hmac-key-file` / `$WEIGHTSYNC_HMAC_KEY` on engines."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any, Mapping

from .errors import PayloadError

ENV = "WEIGHTSYNC_HMAC_KEY"


def load_key(key: str | None = None, key_file: str | None = None) -> bytes | None:
    """The shared key from an argument, a file or $WEIGHTSYNC_HMAC_KEY (None: unsigned)."""
    if key_file:
        raw = Path(key_file).read_bytes().strip()
        if len(raw) < 16:
            raise ValueError(f"HMAC key file {key_file} holds {len(raw)} bytes; use at least 16")
        return raw
    text = key or os.environ.get(ENV)
    if not text:
        return None
    if len(text) < 16:
        raise ValueError("an HMAC key must be at least 16 characters")
    return text.encode()


def _claims(version: int, header: Mapping[str, Any]) -> bytes:
    tensors = [[t.get("name"), t.get("dtype"), list(t.get("shape") or [])]
               for t in header.get("tensors") or []]
    return json.dumps([int(version), int(header.get("index", -1)), bool(header.get("last")),
                       str(header.get("encoding")), str(header.get("digest")), tensors],
                      separators=(",", ":")).encode()


def sign(key: bytes, version: int, header: Mapping[str, Any]) -> str:
    return hmac.new(key, _claims(version, header), hashlib.sha256).hexdigest()


def check(key: bytes | None, version: int, header: Mapping[str, Any]) -> None:
    """Refuse a payload whose signature does not match (only when this side holds a key)."""
    if key is None:
        return
    got = header.get("sig")
    if not isinstance(got, str) or not hmac.compare_digest(got, sign(key, version, header)):
        what = "has no signature" if got is None else "has a wrong signature"
        raise PayloadError(f"bucket {header.get('index')} {what}: it was not sent by a trainer "
                           f"holding this engine's HMAC key (a forged payload, or the trainer "
                           f"lacks sync.hmac_key_file); nothing was applied")
