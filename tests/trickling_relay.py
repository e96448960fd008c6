"""A reference engine whose relay trickles: of every bucket it forwards the first piece at full
speed and the rest at one byte a second (the process stays up and keeps its connections open),
while it stages what it receives at full speed. For the relay shapes' slow-member test: its
children give up on it after `stall` seconds, and the trainer must stop planning it as a relay
after the first bucket, not pay a stall on every bucket. Run as
`python trickling_relay.py serve ...` (the same arguments as `weightsync serve`)."""

from __future__ import annotations

import sys
import threading
from typing import Iterator

from weightsync.cli import main
from weightsync.transports.http import member_relay as relay_module

_honest = relay_module.Feed.piece


class Trickle(list):
    """One piece's bytes, a byte a second (a list, so the feed yields from it)."""

    def __init__(self, data: bytes) -> None:
        super().__init__()
        self.data = data

    def __iter__(self) -> Iterator[bytes]:  # type: ignore[override]
        for i in range(len(self.data)):
            threading.Event().wait(1.0)
            yield self.data[i:i + 1]


def trickling_piece(self, a, b):  # noqa: ANN001, ANN201
    if a == 0:
        return _honest(self, a, b)
    return Trickle(bytes(self.body[a:b]))


relay_module.Feed.piece = trickling_piece

if __name__ == "__main__":
    sys.exit(main())
