"""Engine calls (join, announce) that run on their own threads while rank 0 broadcasts."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Call:
    """An engine call running on its own thread; `wake` is set if it fails."""

    thread: threading.Thread
    error: list[BaseException] = field(default_factory=list)
    wake: threading.Event | None = None

    def done(self, timeout: float | None = None) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def _spawn(fn: Any, *args: Any, wake: threading.Event | None = None) -> _Call:
    call = _Call(threading.Thread(target=lambda: None), wake=wake)

    def run() -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - collected by the caller
            call.error.append(e)
            if call.wake is not None:
                call.wake.set()

    call.thread = threading.Thread(target=run, daemon=True, name="ws-collective")
    call.thread.start()
    return call


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text
