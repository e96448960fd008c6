"""A reference engine that relays honestly-shaped but tampered bytes: every piece it forwards to
its children has one bit flipped (what it stages for itself is what it received). For the relay
shapes' trust test: its children must refuse the bucket and the trainer must blame it. Run as
`python tampering_relay.py serve ...` (the same arguments as `weightsync serve`)."""

from __future__ import annotations

import sys

from weightsync.cli import main
from weightsync.transports.http import member_relay as relay_module
def tampered_piece(self, a, b):  # noqa: ANN001, ANN201
    out = bytearray(self.body[a:b])
    out[len(out) // 2] ^= 0x01
    return bytes(out)


relay_module.Feed.piece = tampered_piece

if __name__ == "__main__":
    sys.exit(main())
