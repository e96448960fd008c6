"""A reference engine whose relay replays: in its first push it forwards honestly and keeps a copy
of every frame it sent each child; from then on it forwards, for each bucket, the frame (header
and body) it sent that child for the same bucket in the previous push: the previous version's
bytes, well formed, every piece matching the digests of that version. For the relay shapes'
trust test: the child must refuse the header before any body byte is read and name this relay
to the trainer. Run as `python stale_relay.py serve ...` (the same arguments as `weightsync
serve`)."""

from __future__ import annotations

import json
import sys
import threading
from typing import Iterator

from weightsync.cli import main
from weightsync.transports.http import member_relay as relay_module

_honest_iter = relay_module.Feed.__iter__
_sent: dict[tuple[str, int], bytes] = {}      # (child, bucket index) -> the frame sent it
_lock = threading.Lock()


def _key(feed: relay_module.Feed) -> tuple[str, int]:
    return str(feed.child["name"]), int(json.loads(bytes(feed.prefix[1]))["index"])


def replaying_len(self) -> int:  # noqa: ANN001
    with _lock:
        old = _sent.get(_key(self))
    return len(old) if old is not None else sum(len(p) for p in self.prefix) + len(self.body)


def replaying_iter(self) -> Iterator[bytes]:  # noqa: ANN001
    key = _key(self)
    with _lock:
        old = _sent.get(key)
    if old is not None:
        yield old
        return
    out = bytearray()
    for part in _honest_iter(self):
        out += bytes(part)
        yield part
    with _lock:
        _sent[key] = bytes(out)


relay_module.Feed.__len__ = replaying_len  # type: ignore[method-assign]
relay_module.Feed.__iter__ = replaying_iter  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
