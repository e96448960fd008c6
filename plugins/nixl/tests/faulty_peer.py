"""A peer host (`weightsync_nixl.serve`) that fails on purpose once a joiner reported reading its
first bucket: `kill` (SIGKILL to itself: a peer dying mid-read), `withdraw` (its memory is
deregistered under the joiner), `stop` (SIGSTOP to itself: a READ that never completes).
Usage: python faulty_peer.py MODE <serve arguments>."""

from __future__ import annotations

import os
import signal
import sys
import time

from weightsync_nixl import peer_host, serve

MODE = sys.argv.pop(1)


def _count(self: peer_host.PeerHost) -> None:
    while not self._stop.is_set():
        with self.agent.lock:
            notes = self.agent.nixl.get_new_notifs()
        if any(m.startswith(b"read:") for msgs in notes.values() for m in msgs):
            if MODE == "withdraw":
                self.withdraw()
                return
            os.kill(os.getpid(), signal.SIGKILL if MODE == "kill" else signal.SIGSTOP)
        time.sleep(0.0005)


peer_host.PeerHost._count = _count    # type: ignore[method-assign]
sys.exit(serve.main())
