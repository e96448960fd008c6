"""One round over a group of engines that take the same payloads (one encoding, one plan):

    pause (engines that apply as they receive, or every engine with `pause: sync`)
    begin -> stream -> finish -> end (digests) -> verify
    per engine, on its own: pause (the others: only now) -> commit -> resume
    confirm (acknowledging adapters)

An engine that fails at any stage is dropped, aborted if it began and resumed if it was paused,
while the others go on; no engine stays paused while it waits for another, and the aborts of
dropped engines are awaited only once every live engine is serving again."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

from weightsync.config import SyncSettings
from weightsync.errors import EngineUnavailable, EngineUnreachable, WeightSyncError
from weightsync.interfaces import Adapter, Encoding, NameMap, Transport
from weightsync.sync.ranks import world
from weightsync.sync.report import SyncReport
from weightsync.sync.stream import Stream


log = logging.getLogger("weightsync.sync.pipeline")


class Clock:
    """The push's start and deadline, and per-stage seconds."""

    def __init__(self, deadline: float) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + deadline
        self.seconds = deadline
        self.stages: dict[str, float] = {}
        self.lock = threading.Lock()

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    @property
    def sending(self) -> float:
        """When sending must end: the deadline less a tenth of it (at most 60 s) kept for verify and
        commit, so engines holding every bucket commit even if a relay or link ate the rest."""
        return self.deadline - min(self.seconds / 10, 60.0)

    def since(self) -> float:
        return time.monotonic() - self.start

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self.lock:
                self.stages[stage] = self.stages.get(stage, 0.0) + time.perf_counter() - t0


class Calls:
    """Engine calls in parallel, each answer awaited no later than the deadline."""

    def __init__(self, pool: ThreadPoolExecutor, clock: Clock) -> None:
        self.pool, self.clock = pool, clock

    def each(self, adapters: Sequence[Adapter], fn: Callable[[Adapter], Any]
             ) -> tuple[dict[str, Any], dict[str, BaseException]]:
        futures = {a.engine_name: self.pool.submit(fn, a) for a in adapters}
        wait(list(futures.values()), timeout=self.clock.left())
        results: dict[str, Any] = {}
        failures: dict[str, BaseException] = {}
        for name, f in futures.items():
            if not f.done():
                failures[name] = EngineUnavailable(name, f"no answer within the push deadline "
                                                         f"({self.clock.seconds:g}s)")
                continue
            try:
                results[name] = f.result()
            except BaseException as e:  # noqa: BLE001 - recorded per engine, never swallowed
                failures[name] = e
        return results, failures


class Renewer:
    """Renews the leases of `members` every third of the lease, off the main thread. A failed
    renewal is only logged: that engine's lease lapses, and the next call to it reports it."""

    def __init__(self, lease: float) -> None:
        self.every = max(0.05, lease / 3)
        self.members: dict[str, Adapter] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ws-renew")
        self.thread = threading.Thread(target=self._run, name="ws-renewer", daemon=True)
        self.thread.start()

    def add(self, adapters: Sequence[Adapter]) -> None:
        with self.lock:
            self.members.update((a.engine_name, a) for a in adapters if a.leases)

    def remove(self, adapters: Sequence[Adapter]) -> None:
        with self.lock:
            for a in adapters:
                self.members.pop(a.engine_name, None)

    def _one(self, a: Adapter) -> None:
        try:
            a.renew()
        except Exception as e:  # noqa: BLE001 - see the class docstring
            log.debug("engine %s: lease renewal failed: %s", a.engine_name, e)

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            with self.lock:
                members = list(self.members.values())
            for a in members:
                self.pool.submit(self._one, a)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pool.shutdown(wait=False)


def _resume(adapter: Adapter, attempts: int = 4, backoff: float = 0.25) -> None:
    """Resume is idempotent and the one call that must not be lost (a paused engine serves no
    one), so a connection that fails before any answer (an engine closing an idle keep-alive
    socket just as it is reused) is retried on a fresh one. A refusal or a timeout is not."""
    for k in range(attempts):
        try:
            adapter.resume()
            return
        except EngineUnreachable:
            if k == attempts - 1:
                raise
            time.sleep(backoff * 2 ** k)


class _Failed(Exception):
    """An engine's call failed at `stage` (pause or commit) of its own landing."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(str(error))
        self.stage, self.error = stage, error


class GroupRound:
    """One round over `engines` (see the module docstring)."""

    def __init__(self, settings: SyncSettings, stream: Stream, encoding: Encoding,
                 transport: Transport, plan: Mapping[str, Any], calls: Calls, clock: Clock,
                 report: SyncReport, renewer: Renewer, caught_up: bool = False) -> None:
        self.settings, self.stream, self.encoding, self.transport = settings, stream, encoding, transport
        self.plan, self.calls, self.clock, self.report = plan, calls, clock, report
        self.renewer, self.caught_up = renewer, caught_up
        self.begun: set[str] = set()
        self.paused: dict[str, float] = {}            # engine -> when its pause began
        self.digests: dict[int, str] = {}             # the sender's, per bucket of this round
        self.lock = threading.Lock()
        self.aborts: list[Any] = []                   # aborts of dropped engines, in flight

    # -- bookkeeping --------------------------------------------------------------------------
    def drop(self, active: list[Adapter], failures: Mapping[str, BaseException], stage: str
             ) -> list[Adapter]:
        if not failures:
            return active
        dropped = [a for a in active if a.engine_name in failures]
        for a in dropped:
            o = self.report.engines[a.engine_name]
            o.fail(stage, str(failures[a.engine_name]))
            o.seconds = self.clock.since()
            log.info("engine %s failed at %s: %s", a.engine_name, stage, failures[a.engine_name])
        self.renewer.remove(dropped)
        self._abort_beside([a for a in dropped if a.engine_name in self.begun])
        return [a for a in active if a.engine_name not in failures]

    def _abort_beside(self, adapters: Sequence[Adapter]) -> None:
        """Abort without waiting (a hung engine must not hold the live ones paused); `_settle`
        awaits the answers. Best effort: a dead engine's round lease ends it anyway."""
        for a in adapters:
            self.begun.discard(a.engine_name)
            self.aborts.append(self.calls.pool.submit(a.abort))

    def _settle(self) -> None:
        if self.aborts:
            wait(self.aborts, timeout=self.clock.left())
            self.aborts = []

    def _pause(self, adapters: list[Adapter], mode: str | None) -> dict[str, BaseException]:
        t = time.monotonic()
        _, fails = self.calls.each(adapters, lambda a: a.pause(mode or a.pause_modes[0]))
        with self.lock:
            for a in adapters:
                if a.engine_name not in fails:
                    self.paused[a.engine_name] = t
        self.renewer.add([a for a in adapters if a.engine_name not in fails])
        return fails

    def _resume_one(self, a: Adapter) -> None:
        """Resume `a` if this round paused it; its pause window counts only when it answered
        (a dead engine's resume retries say nothing about how long a live one stood still)."""
        with self.lock:
            t = self.paused.pop(a.engine_name, None)
        if t is None:
            return
        t0 = time.monotonic()
        try:
            _resume(a)
            self._longest("resume", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - logged; a leased pause ends by itself
            log.warning("engine %s did not resume: %s (a leased pause ends by itself)",
                        a.engine_name, e)
            return
        window = time.monotonic() - t
        with self.lock:
            self.report.engines[a.engine_name].pause_window = window
            self.report.pause_window = max(self.report.pause_window, window)

    def _resume_all(self) -> None:
        """Engines this round paused and did not resume yet (dropped, or the round failed)."""
        self.calls.each([a for a in self._all if a.engine_name in self.paused], self._resume_one)

    def _longest(self, stage: str, seconds: float) -> None:
        """A stage that runs per engine, in parallel: the report shows the longest."""
        with self.clock.lock:
            self.clock.stages[stage] = max(self.clock.stages.get(stage, 0.0), seconds)

    def _land(self, a: Adapter, version: int) -> None:
        """Pause (unless paused already), commit and resume one engine, on its own: no engine
        stays paused while another's call hangs."""
        if a.engine_name not in self.paused:
            t = time.monotonic()
            try:
                a.pause(self.settings.pause_mode or a.pause_modes[0])
            except BaseException as e:
                raise _Failed("pause", e) from e
            self._longest("pause", time.monotonic() - t)
            with self.lock:
                self.paused[a.engine_name] = t
            self.renewer.add([a])
        try:
            a.commit(version)
        except BaseException as e:
            raise _Failed("commit", e) from e
        finally:
            self.renewer.remove([a])
            self._resume_one(a)

    # -- the round ----------------------------------------------------------------------------
    def run(self, model: Any, name_map: NameMap | None, engines: list[Adapter], *,
            mode: str = "engines", count: bool = True) -> list[Adapter]:
        """Returns the engines that committed this round's version."""
        self._all = list(engines)
        for a in engines:
            self.report.engines[a.engine_name].caught_up = self.caught_up
        clock, version = self.clock, self.report.version
        active = list(engines)
        first = {a.engine_name for a in active if not a.staging or self.settings.pause == "sync"}
        try:
            # the round (and its lease) opens before any engine is paused: a trainer that dies
            # at any point leaves no engine paused by a round that nothing will end (an engine's
            # own pause may have no lease: vLLM's has none)
            with clock.timed("begin"):
                _, fails = self.calls.each(active, lambda a: a.begin(version, self.plan))
            self.begun = {a.engine_name for a in active if a.engine_name not in fails}
            active = self.drop(active, fails, "begin")
            self.renewer.add(active)
            if any(a.engine_name in first for a in active):
                with clock.timed("pause"):
                    active = self.drop(active, self._pause([a for a in active if a.engine_name in first],
                                                           self.settings.pause_mode), "pause")
            sent = self._send(model, name_map, active, mode, count)
            if sent is None:
                return []
            active = self._verify(sent, version)
            with clock.timed("commit"):
                _, fails = self.calls.each(active, lambda a: self._land(a, version))
            at_pause = {n: e.error for n, e in fails.items()
                        if isinstance(e, _Failed) and e.stage == "pause"}
            active = self.drop(active, at_pause, "pause")
            self.begun -= {a.engine_name for a in active}
            fails = {n: getattr(e, "error", e) for n, e in fails.items() if n not in at_pause}
            self._commit_failed(active, fails)
            active = [a for a in active if a.engine_name not in fails]
            for a in active:
                self.report.engines[a.engine_name].version = version
        except BaseException as e:
            for a in active:
                self.report.engines[a.engine_name].fail("send", f"sync aborted: {type(e).__name__}: {e}")
            self._abort_beside([a for a in self._all if a.engine_name in self.begun])
            raise
        finally:
            self.renewer.remove(self._all)
            self._resume_all()
            self._settle()
        self._confirm(active, version)
        for a in active:
            self.report.engines[a.engine_name].seconds = clock.since()
        return [a for a in active if self.report.engines[a.engine_name].ok]

    def _send(self, model: Any, name_map: NameMap | None, active: list[Adapter], mode: str,
              count: bool) -> list[Adapter] | None:
        """open -> stream -> finish: the engines that hold every payload (None: no engine is
        left and no other rank needs this export pass)."""
        clock, version = self.clock, self.report.version
        with clock.timed("open"):
            active = self.drop(active, self.transport.open(active, version), "open")
        if not active and mode == "engines":
            if world() is None:
                return None
            mode = "encode"         # follower ranks run this export pass: so must rank 0
        active = self.stream.run(model, name_map, self.report, active, self.drop,
                                 self.digests, mode=mode, count=count)
        with clock.timed("finish"):
            active = self.drop(active, self.transport.finish(active), "send")
        for n, text in self.transport.remarks().items():
            if n in self.report.engines:
                self.report.engines[n].remark = text
        return active

    def _verify(self, active: list[Adapter], version: int) -> list[Adapter]:
        with self.clock.timed("verify"):
            got, fails = self.calls.each(active, lambda a: a.end())
        expected = self.digests
        for name, digests in got.items():
            if self.settings.verify and digests != expected:
                bad = sorted(i for i in set(expected) | set(digests) if digests.get(i) != expected.get(i))
                fails[name] = WeightSyncError(
                    f"digest mismatch in buckets {bad[:10]}: the engine holds different bytes "
                    f"than were sent; it was not moved to version {version}")
        active = self.drop(active, fails, "verify")
        for a in active:
            digest_checked = self.settings.verify and a.verification == "digest"
            self.report.engines[a.engine_name].status = "verified" if digest_checked else "acknowledged"
        return active

    def _commit_failed(self, active: list[Adapter], fails: Mapping[str, BaseException]) -> None:
        """An engine that failed at commit is reported with the version it holds now."""
        failed = [a for a in active if a.engine_name in fails]
        statuses, _ = self.calls.each(failed, lambda a: a.health())
        for a in failed:
            o = self.report.engines[a.engine_name]
            o.fail("commit", str(fails[a.engine_name]))
            st = statuses.get(a.engine_name)
            o.version = st.version if st is not None else None
            o.seconds = self.clock.since()

    def _confirm(self, active: list[Adapter], version: int) -> None:
        """Acknowledging adapters read back what the engine holds, where they can."""
        ack = [a for a in active if self.report.engines[a.engine_name].status == "acknowledged"
               and a.verification == "ack" and self.settings.verify]
        if not ack:
            return
        with self.clock.timed("confirm"):
            got, fails = self.calls.each(ack, lambda a: a.confirm(version))
        for a in ack:
            o = self.report.engines[a.engine_name]
            if a.engine_name in fails:
                o.fail("confirm", f"after commit the engine holds other values than were sent: "
                                  f"{fails[a.engine_name]}")
            elif got.get(a.engine_name):
                o.status = "verified"
