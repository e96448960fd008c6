"""Requests that must not wait on an engine that stopped: while a generation runs on an engine,
the engine's `/health` is asked about every second on the side; an engine that answers nothing
(not a probe, not the generation) for `stuck` seconds, or a member that left the fleet, has its
running calls cancelled (their connections shut, so the engine drops the work when it wakes)
and the client sends those prompts to another engine. So a prompt moves off a frozen engine
within about `stuck` + 1 seconds. A caller that goes away (`cancel`) has its calls cancelled
the same way."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from weightsync_rl.rollout.cancel import Scope

__all__ = ["Liveness"]

log = logging.getLogger("weightsync_rl.rollout")
PROBE_EVERY = 1.0


class Liveness:
    """The running calls per engine, and the watcher that cancels the calls of a stuck one.
    `slots()` gives the members now (objects with `name`, `adapter`, `alive_at`)."""

    def __init__(self, stuck: float, slots: Callable[[], list[Any]]) -> None:
        if stuck <= 0:
            raise ValueError("stuck must be > 0 seconds")
        self.stuck, self.slots = stuck, slots
        self.lock = threading.Lock()
        self.running: dict[str, set[Scope]] = {}        # engine name -> its calls now
        self.callers: dict[Scope, threading.Event] = {}  # a call -> its caller's cancel
        self.probing: dict[str, float] = {}             # engine name -> when its probe began
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()

    def begin(self, slot: Any, cancel: threading.Event | None = None) -> Scope:
        """A call starts on `slot`: it counts as alive from now; `cancel` set cancels it."""
        scope = Scope()
        with self.lock:
            slot.alive_at = max(slot.alive_at, time.monotonic())
            self.running.setdefault(slot.name, set()).add(scope)
            if cancel is not None:
                self.callers[scope] = cancel
            if self.thread is None:
                self.thread = threading.Thread(target=self._watch, name="ws-rollout-watch",
                                               daemon=True)
                self.thread.start()
        return scope

    def end(self, slot: Any, scope: Scope, answered: bool) -> None:
        """The call ended; an answer (even a refusal) is a sign of life."""
        scope.close()                        # later cancels reach no reused connection
        with self.lock:
            self.running.get(slot.name, set()).discard(scope)
            self.callers.pop(scope, None)
            if answered:
                slot.alive_at = time.monotonic()

    def _watch(self) -> None:
        while not self.stop.wait(0.25):
            now = time.monotonic()
            try:
                slots = {s.name: s for s in self.slots()}
            except Exception as e:  # noqa: BLE001 - the fleet's registry did not answer
                log.info("members unknown this moment: %s", e)
                continue
            with self.lock:
                busy = {n: set(sc) for n, sc in self.running.items() if sc}
                gone = [sc for sc, ev in self.callers.items() if ev.is_set()]
            for sc in gone:
                sc.cancel("cancelled")
            for name, scopes in busy.items():
                slot = slots.get(name)
                if slot is None:
                    why = f"{name} left the fleet while it held the request"
                elif now - slot.alive_at > self.stuck:
                    why = (f"{name} answered nothing (not even /health) for "
                           f"{now - slot.alive_at:.0f}s")
                else:
                    self._probe(slot, now)
                    continue
                log.warning("%s; its requests move to another engine", why)
                for sc in scopes:
                    sc.cancel(why)

    def _probe(self, slot: Any, now: float) -> None:
        with self.lock:
            began = self.probing.get(slot.name)
            if began is not None and (began < 0 or now - began < PROBE_EVERY):
                return                       # one in flight, or one answered a moment ago
            self.probing[slot.name] = -1.0

        def run() -> None:
            try:
                slot.adapter.health()
                with self.lock:
                    slot.alive_at = time.monotonic()
            except Exception:  # noqa: BLE001 - no answer: the engine may be stuck
                pass
            finally:
                with self.lock:
                    self.probing[slot.name] = time.monotonic()
        threading.Thread(target=run, name="ws-rollout-probe", daemon=True).start()

    def close(self) -> None:
        self.stop.set()
