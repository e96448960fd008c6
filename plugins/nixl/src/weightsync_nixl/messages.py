"""The nixl transport's own message and how its body is read: every field is checked (types,
sizes, names, descriptor lengths against the payload's byte count) before any byte moves."""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Any, Mapping

from weightsync.errors import PayloadError
from weightsync.interfaces import Message
from weightsync_nixl.agent import NAME_RE, Desc

__all__ = ["MAX_DESCS", "MAX_METADATA", "Location", "NixlRead", "b64", "parse_descs",
           "parse_metadata", "parse_read"]

MAX_METADATA = 64 << 10          # an agent's metadata is ~290 bytes over UCX; a few kB with NICs
MAX_DESCS = 64
MAX_NOTIF = 256
MEM_TYPES = ("DRAM", "VRAM")


class NixlRead(Message):
    """A payload to READ from the trainer's registered memory: `body` is {"header": the payload header,
    "agent", "metadata" (base64), "mem", "descs" ([[address, length, device], ...]), "notif",
    "deadline" (seconds the engine may take)}. The engine READs into its registered staging
    memory (NIXL tells the trainer with `notif` when the bytes have left), stages the payload
    and answers {"digest": ..., "agent": its agent's name}."""

    kind = "nixl.read"


@dataclass(frozen=True)
class Location:
    header: Mapping[str, Any]
    agent: str
    metadata: bytes
    mem: str
    descs: list[Desc]
    notif: bytes
    deadline: float
    nbytes: int


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _int(x: Any, what: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
        raise PayloadError(f"nixl: {what} must be an integer in [{lo}, {hi}], not {x!r}")
    return x


def parse_metadata(raw: Any) -> bytes:
    if not isinstance(raw, str) or len(raw) > MAX_METADATA * 4 // 3 + 4:
        raise PayloadError(f"nixl: agent metadata must be base64 text of at most {MAX_METADATA} bytes")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise PayloadError("nixl: agent metadata is not valid base64") from None


def parse_descs(raw: Any, nbytes: int, what: str) -> list[Desc]:
    """Descriptors as [[address, length, device], ...] whose lengths add up to `nbytes`."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_DESCS:
        raise PayloadError(f"nixl: {what}: descriptors must be a list of 1 to {MAX_DESCS} "
                           f"[address, length, device] triples")
    out: list[Desc] = []
    for d in raw:
        if not isinstance(d, list) or len(d) != 3:
            raise PayloadError(f"nixl: {what}: descriptor {d!r} is not [address, length, device]")
        out.append((_int(d[0], "a descriptor's address", 1), _int(d[1], "a descriptor's length"),
                    _int(d[2], "a descriptor's device", 0, 1023)))
    if sum(d[1] for d in out) != nbytes:
        raise PayloadError(f"nixl: {what}: descriptors cover {sum(d[1] for d in out)} bytes, the "
                           f"payload has {nbytes}")
    return out


def parse_read(body: Mapping[str, Any], max_bytes: int) -> Location:
    """A `nixl.read` body, checked; `max_bytes`: the largest payload this engine takes."""
    header = body.get("header")
    if not isinstance(header, Mapping):
        raise PayloadError("nixl: a nixl.read message needs the payload's header")
    nbytes = _int(header.get("nbytes"), "the payload's nbytes", 0, max_bytes)
    what = f"bucket {header.get('index')}"
    agent = body.get("agent")
    if not isinstance(agent, str) or not NAME_RE.match(agent):
        raise PayloadError(f"nixl: {what}: agent {agent!r} is not a weightsync agent's name")
    mem = body.get("mem")
    if mem not in MEM_TYPES:
        raise PayloadError(f"nixl: {what}: memory type {mem!r} is not one of {MEM_TYPES}")
    notif = body.get("notif")
    if not isinstance(notif, str) or not 0 < len(notif) <= MAX_NOTIF or not notif.isascii():
        raise PayloadError(f"nixl: {what}: notif must be 1 to {MAX_NOTIF} ASCII characters")
    deadline = body.get("deadline")
    if (not isinstance(deadline, (int, float)) or isinstance(deadline, bool)
            or not math.isfinite(deadline) or not 0 < deadline <= 86400):
        raise PayloadError(f"nixl: {what}: deadline must be seconds in (0, 86400], not {deadline!r}")
    descs = parse_descs(body.get("descs"), nbytes, what) if nbytes else []
    return Location(header, agent, parse_metadata(body.get("metadata")), str(mem), descs,
                    notif.encode(), float(deadline), nbytes)
