"""The announce-ahead state of transport `collective`: announces made for the next payload while
the bucket before it is still being broadcast, and when they go stale."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.interfaces import Adapter, Payload
from weightsync.transports.collective.messages import Broadcast
from weightsync.interfaces.capabilities import group_ranks
from weightsync.transports.collective import pg as pgs
from weightsync.transports.collective.calls import _Call, _spawn


@dataclass
class _Ahead:
    """The announces of a payload made while the previous bucket was still being broadcast."""

    group: str
    seq: int
    engines: tuple[str, ...]
    calls: dict[str, "_Call"]
    wake: threading.Event


class AnnounceAhead:
    """The announce-ahead half of `CollectiveTransport`, which holds the attributes named here."""

    group: pgs.Group | None
    key: tuple | None
    _seq: int
    _ahead: dict[int, _Ahead]
    _ahead_seq: int
    _ahead_next: int
    _ahead_lock: threading.Lock
    _layout: Any

    def announce_ahead(self, payload: Payload, engines: Sequence[Adapter]) -> None:
        """Announce `payload` as soon as it is packed, while the bucket before it is still being
        broadcast, so every engine has posted its receive when the next broadcast starts. Only
        for `ordered_announces` engines, the safetensors layout, payloads in bucket order, on
        the group `open` built for these engines; otherwise `send` announces. An announce never
        broadcast poisons its group: the next round builds a new one."""
        engines = list(engines)
        group = self.group          # the sending thread may be replacing it: one look
        with self._ahead_lock:
            try:
                fits = (payload.index == self._ahead_next and group is not None and bool(engines)
                        and all(a.ordered_announces for a in engines)
                        and self.key == tuple((a.engine_name, group_ranks(a)) for a in engines)
                        and self._layout(engines) == "safetensors")
            except Exception:  # noqa: BLE001 - send announces it then, and reports what is wrong
                fits = False
            if not fits or group is None:
                self._ahead_next = -1           # out of order once: not again this round
                return
            seq = self._ahead_seq
            self._ahead_seq += 1
            self._ahead_next += 1
            body = payload.body
            header = payload.header(group_name=group.name, layout="safetensors", seq=seq,
                                    nbytes=body.numel() * body.element_size(), dtype="uint8",
                                    numel=body.numel())
            wake = threading.Event()
            calls = {a.engine_name: _spawn(a.deliver, Broadcast(header), wake=wake) for a in engines}
            self._ahead[payload.index] = _Ahead(group.name, seq, tuple(a.engine_name for a in engines),
                                                calls, wake)

    def _take_ahead(self, payload: Payload, engines: Sequence[Adapter]) -> _Ahead | None:
        """The announces made ahead for `payload`, if they still fit the group and this seq."""
        with self._ahead_lock:
            ahead = self._ahead.pop(payload.index, None)
            if ahead is None:
                return None
            if (self.group is not None and ahead.group == self.group.name and ahead.seq == self._seq
                    and ahead.engines == tuple(a.engine_name for a in engines)):
                return ahead
            self._drop_ahead(ahead)
            return None

    def _drop_ahead(self, ahead: _Ahead) -> None:
        """(`_ahead_lock` held) An announce made ahead that will never be broadcast: none more
        this round, and its group (if current) must be rebuilt."""
        self._ahead_next = -1
        if self.group is not None and ahead.group == self.group.name:
            self.key = None

    def _forget_ahead(self) -> None:
        """Announces made ahead that will never be broadcast."""
        with self._ahead_lock:
            for ahead in self._ahead.values():
                self._drop_ahead(ahead)
            self._ahead.clear()
            self._ahead_next = -1
