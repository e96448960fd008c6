"""A reference engine that is a bad peer for a peer join (it takes pushes and relays honestly):
`refuse` answers every share request with HTTP 503; `lie` serves, for a join, weights that are
not the ones it holds (one tensor shifted by one), with a manifest and frames that agree with
them, so only the trainer's digests (the anchor) can catch it. For the in-push peer join tests.
Run as `python bad_peer.py refuse|lie serve ...` (then the same arguments as `weightsync serve`)."""

from __future__ import annotations

import sys
from typing import Any

import torch

from weightsync.cli import main
from weightsync.fleets import peer as peer_module
from weightsync.net.server import HttpError
from weightsync_reference.server import engine as engine_module


class _LyingStore:
    """The engine's store, with its first non-empty floating tensor shifted (a copy; the live
    one stays)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.bad = next(n for n in store.names()
                        if store.get(n).is_floating_point() and store.get(n).numel())

    def names(self) -> list[str]:
        return self.store.names()

    def get(self, name: str) -> torch.Tensor:
        t = self.store.get(name)
        return t + 1 if name == self.bad else t


def _refuse(self: Any, token: str, ttl: float) -> dict[str, Any]:
    raise HttpError(503, "this peer refuses to share its weights (bad_peer.py refuse)")


def _lying(method: Any) -> Any:
    def wrapped(self: Any, *args: Any) -> Any:
        return method(self, *args[:-1], _LyingStore(args[-1]))
    return wrapped


if __name__ == "__main__":
    mode = sys.argv.pop(1)
    if mode == "refuse":
        engine_module.ReferenceEngine.share = _refuse
    elif mode == "lie":
        peer_module.Shares.manifest = _lying(peer_module.Shares.manifest)
        peer_module.Shares.bucket = _lying(peer_module.Shares.bucket)
    else:
        sys.exit(f"bad_peer.py: mode must be refuse or lie, not {mode!r}")
    sys.exit(main())
