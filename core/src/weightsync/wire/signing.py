"""Signed payloads: an HMAC key shared by the trainer and the engines (xxh3 catches corruption,
not forgery). With a key, every payload header carries `sig`, an HMAC-SHA256 over what the payload
claims (version, index, last, encoding, digest, tensors); an engine holding the key refuses a
payload whose signature is missing or wrong, and its digest check binds the bytes to the signed
digest. Keys: `sync.hmac_key_file`, `weightsync serve --hmac-key-file` or $WEIGHTSYNC_HMAC_KEY."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any, Mapping

from weightsync.errors import PayloadError

__all__ = ["ENV", "SIGNATURE_FILE", "check", "check_checkpoint", "checkpoint_signature", "load_key",
           "sign", "sign_checkpoint", "tensor_digests"]

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


# -- signed checkpoints (load_from_disk) ------------------------------------------------------
SIGNATURE_FILE = "weightsync-signature.json"


def tensor_digests(named: Mapping[str, Any]) -> dict[str, str]:
    """SHA-256 per tensor over its name, dtype, shape and bytes: what a checkpoint's signature binds
    (cryptographic: a signature over xxh3 would not stop a forger who can write the directory)."""
    import torch
    out = {}
    for name in sorted(named):
        t = named[name].detach().to("cpu").contiguous()
        h = hashlib.sha256(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        out[name] = h.hexdigest()
    return out


def _checkpoint_mac(key: bytes, version: int, digests: Mapping[str, str]) -> str:
    claims = json.dumps({"version": int(version), "tensors": dict(sorted(digests.items()))},
                        separators=(",", ":")).encode()
    return hmac.new(key, claims, hashlib.sha256).hexdigest()


def checkpoint_signature(key: bytes, path: str | Path, version: int) -> dict[str, Any]:
    """The signature of checkpoint directory `path` as `version`: each tensor's digest and an
    HMAC over them and the version (sent with load_from_disk, or written by `sign_checkpoint`)."""
    from weightsync.wire.checkpoint import read_checkpoint
    digests = tensor_digests(read_checkpoint(path, lambda n, t: None))
    return {"version": int(version), "tensors": digests,
            "sig": _checkpoint_mac(key, version, digests)}


def sign_checkpoint(key: bytes, path: str | Path, version: int) -> Path:
    """Write `checkpoint_signature` into `path`/weightsync-signature.json."""
    out = Path(path) / SIGNATURE_FILE
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(checkpoint_signature(key, path, version)))
    os.replace(tmp, out)
    return out


def check_checkpoint(key: bytes | None, path: str | Path, version: int,
                     named: Mapping[str, Any], signature: Any = None) -> None:
    """Refuse a checkpoint (already read into `named`) not signed with `key` as `version` (only when
    this side holds a key); the signature comes with the request or from the directory's file."""
    if key is None:
        return
    f = Path(path) / SIGNATURE_FILE
    hint = ("an engine holding an HMAC key loads only checkpoints signed with it "
            "(weightsync.wire.signing.sign_checkpoint); nothing was applied")
    try:
        raw = signature if signature is not None else json.loads(f.read_text())
    except FileNotFoundError:
        raise PayloadError(f"checkpoint {path} is not signed (no {SIGNATURE_FILE}): {hint}") from None
    except (OSError, ValueError) as e:
        raise PayloadError(f"checkpoint {path}: {SIGNATURE_FILE} is unreadable ({e}): {hint}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("tensors"), dict) \
            or not isinstance(raw.get("version"), int):
        raise PayloadError(f"checkpoint {path}: {SIGNATURE_FILE} is malformed: {hint}")
    got = raw.get("sig")
    if not isinstance(got, str) or not hmac.compare_digest(
            got, _checkpoint_mac(key, raw["version"], raw["tensors"])):
        raise PayloadError(f"checkpoint {path} has a wrong signature: {hint}")
    if raw["version"] != int(version):
        raise PayloadError(f"checkpoint {path} is signed as version {raw['version']}, not "
                           f"{version}; load it as the version it was signed for")
    if tensor_digests(named) != raw["tensors"]:
        raise PayloadError(f"checkpoint {path} holds other tensors than its signature names "
                           f"(changed after it was signed); nothing was applied")
