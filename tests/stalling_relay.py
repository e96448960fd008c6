"""A reference engine whose relay stalls once: the first time it would forward a piece past the
first of a bucket, that feed stops for good (the process stays up, holds the connection, sends
nothing more), while it still stages what it receives. For the relay shapes' stall test: its
children must give up on it after `stall` seconds and be fed by the trainer. Run as
`python stalling_relay.py serve ...` (the same arguments as `weightsync serve`)."""

from __future__ import annotations

import sys
import threading

from weightsync.cli import main
from weightsync.transports.http import member_relay as relay_module
_honest = relay_module.Feed.piece
_stalled = threading.Event()


def stalling_piece(self, a, b):  # noqa: ANN001, ANN201
    if a > 0 and not _stalled.is_set():
        _stalled.set()
        threading.Event().wait()            # this feed never sends another byte
    return _honest(self, a, b)


relay_module.Feed.piece = stalling_piece

if __name__ == "__main__":
    sys.exit(main())
