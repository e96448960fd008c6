"""Rounds and leases inside a vLLM worker, as on weightsync's reference engine: the init_info
that opens a round carries its id and lease (`"round": {"id": ..., "lease": s}`); every
update_info carries the id; another id, or a new round while one is live, is refused; `"renew"`
extends the lease. When a lease lapses (the trainer died) a watchdog thread drops the staged
round, then closes vLLM's weight-update session and resumes generation through the server's own
routes (`"server"` in init_info: the URL and auth header the adapter reaches it at), so the
engine serves its previous version again."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from weightsync.errors import PayloadError

log = logging.getLogger("weightsync.vllm")


class RoundLeases:
    """The live round's id and lease, and the watchdog that drops it when the lease lapses (a
    mixin of the backend, whose lock, staged round and `_ended` it uses)."""

    lock: Any
    round: Any
    _ended: Any

    # plain values, so class-level defaults (the backend's own __init__ is vLLM's signature)
    round_id: str | None = None          # the live round (None: none)
    lease = 10.0
    expires = 0.0                        # time.monotonic() at which the round lapses
    server: dict[str, Any] | None = None
    lapsed = 0

    def _live(self) -> bool:
        return self.round_id is not None and time.monotonic() <= self.expires

    def _open(self, spec: dict[str, Any]) -> None:
        rid, lease = str(spec["id"]), float(spec.get("lease") or 10.0)
        if not 0 < lease <= 3600:
            raise PayloadError(f"lease {lease:g}s is outside (0, 3600] seconds")
        if self._live() and rid != self.round_id:
            raise PayloadError(f"round {self.round_id} is open; round {rid} is refused; the open "
                               f"round's lease expires in {self.expires - time.monotonic():.1f}s "
                               f"unless its trainer renews it")
        self.round_id, self.lease, self.expires = rid, lease, time.monotonic() + lease

    def _check(self, rid: str | None) -> None:
        if rid != self.round_id or not self._live():
            live = (f"round {self.round_id} is, and its lease expires in "
                    f"{self.expires - time.monotonic():.1f}s") if self._live() else "no round is"
            raise PayloadError(f"round {rid} is not the open round: {live}")

    def _renew(self, spec: dict[str, Any]) -> None:
        self._check(str(spec.get("id")))
        self.lease = float(spec.get("lease") or self.lease)
        self.expires = time.monotonic() + self.lease

    def _watch(self) -> None:
        while True:
            time.sleep(0.1)
            with self.lock:
                lapsed = self.round_id is not None and time.monotonic() > self.expires
                if not lapsed:
                    continue
                log.warning("weightsync round %s: lease lapsed after %.1fs without renewal; "
                            "dropping what it staged", self.round_id, self.lease)
                self.round_id = None
                self.lapsed += 1
                if self.round is not None:
                    self.round.aborted = True
                    self.round.staged.clear()
                    self._ended(self.round)
                server = self.server
            if server:              # close vLLM's update session and resume generation
                threading.Thread(target=_after_lapse, args=(server,), daemon=True).start()


def _after_lapse(server: dict[str, Any]) -> None:
    """A lapsed round: end vLLM's weight-update session (its finish loads nothing for a dropped
    round) and resume generation, as the dead trainer would have."""
    import requests
    url, headers = str(server.get("url", "")).rstrip("/"), dict(server.get("headers") or {})
    for path, body in (("/finish_weight_update", {}), ("/resume", None)):
        try:
            requests.post(url + path, json=body, headers=headers, timeout=30)
        except Exception as e:  # noqa: BLE001 - best effort; logged
            log.warning("weightsync: %s after a lapsed lease failed: %s", path, e)
