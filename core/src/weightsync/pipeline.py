"""WeightSync: runs one sync. It only orchestrates: which engines, in which order, what to do when
one fails. Endpoints live in adapters, bytes in encodings, carrying in transports."""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from .config import ResolvedConfig, SyncConfig, resolve
from .errors import EngineUnreachable, SyncError, WeightSyncError
from .interfaces import Adapter, NameMap, Payload
from .plugins import Components, load_components
from .report import EngineOutcome, SyncReport

log = logging.getLogger(__name__)
_DONE = object()


def _is_follower() -> bool:
    """In a multi-rank trainer only rank 0 sends; the others still run the exporter, because
    gathering DTensor shards is a collective every rank must join."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def _model_bytes(model: Any) -> int | None:
    if isinstance(model, torch.nn.Module):
        return sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if isinstance(model, Mapping):
        return sum(t.numel() * t.element_size() for t in model.values())
    return None


class _Progress:
    """A rich progress bar when interactive (or asked for), silent otherwise."""

    def __init__(self, setting: str, total: int | None, version: int) -> None:
        show = setting == "on" or (setting == "auto" and sys.stderr.isatty())
        self.bar = None
        if show:
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
            self.bar = Progress("[progress.description]{task.description}", BarColumn(),
                                DownloadColumn(), TransferSpeedColumn(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(f"sync v{version}", total=total)

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class WeightSync:
    """The pipeline assembled from a SyncConfig. `push(model, version=v)` is the trainer's one call."""

    def __init__(self, resolved: ResolvedConfig, components: Components) -> None:
        self.resolved = resolved
        self.components = components
        self.settings = resolved.config.sync
        r = resolved
        self.exporter = r.exporter_cls(r.exporter_options)
        self.encoding = r.encoding_cls(r.encoding_options)
        self.transport = r.transport_cls(r.transport_options)
        self.adapters: list[Adapter] = [p.adapter_cls(p.adapter_options, p.spec) for p in r.engines]
        self.last_version: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(4, len(self.adapters)),
                                        thread_name_prefix="ws-ctl")

    @classmethod
    def from_config(cls, source: "str | Path | Mapping[str, Any] | SyncConfig", *,
                    components: Components | None = None) -> "WeightSync":
        components = components or load_components()
        return cls(resolve(SyncConfig.load(source), components), components)

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.transport.close()
        for a in self.adapters:
            a.close()
        self._pool.shutdown(wait=False)

    # -- helpers -----------------------------------------------------------------------------
    def _each(self, adapters: Sequence[Adapter], fn: Callable[[Adapter], Any]) -> tuple[dict[str, Any], dict[str, BaseException]]:
        futures = {a.engine_name: self._pool.submit(fn, a) for a in adapters}
        results, failures = {}, {}
        for name, f in futures.items():
            try:
                results[name] = f.result()
            except BaseException as e:  # noqa: BLE001 - recorded per engine, never swallowed
                failures[name] = e
        return results, failures

    def _drop(self, report: SyncReport, active: list[Adapter], failures: Mapping[str, BaseException],
              stage: str, begun: bool) -> list[Adapter]:
        if not failures:
            return active
        dropped = [a for a in active if a.engine_name in failures]
        for a in dropped:
            o = report.engines[a.engine_name]
            o.ok, o.stage, o.error = False, stage, str(failures[a.engine_name])
            log.info("engine %s failed at %s: %s", a.engine_name, stage, failures[a.engine_name])
        if begun:
            self._each(dropped, lambda a: a.abort())  # best effort: a dead engine cannot answer
        return [a for a in active if a.engine_name not in failures]

    # -- the sync ----------------------------------------------------------------------------
    def push(self, model: Any, version: int, *, name_map: NameMap | None = None) -> SyncReport:
        """Send `model` to every engine as weight version `version`; verify; return the report.
        Raises SyncError (with `.report`) when an engine did not end verified at `version`."""
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"version {version} is not newer than the last pushed version "
                             f"{self.last_version}; versions must grow with every sync")
        if _is_follower():
            for _ in self.exporter.buckets(model, name_map=name_map):
                pass
            self.last_version = version
            return SyncReport(version=version, verified=True)
        report = SyncReport(version=version)
        t_start = time.perf_counter()
        stage_t: dict[str, float] = {}

        @contextmanager
        def timed(stage: str) -> Iterator[None]:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                stage_t[stage] = stage_t.get(stage, 0.0) + time.perf_counter() - t0

        if self.transport.publish_only:
            return self._publish(model, version, name_map, report, timed, t_start, stage_t)
        active = list(self.adapters)
        with timed("health"):
            statuses, fails = self._each(active, lambda a: a.health())
        for a in self.adapters:
            st = statuses.get(a.engine_name)
            report.engines[a.engine_name] = EngineOutcome(a.engine_name, True, st.version if st else None)
            if st is not None and st.version >= version:
                fails[a.engine_name] = WeightSyncError(
                    f"engine is already at version {st.version}; push a version above it")
        active = self._drop(report, active, fails, "health", begun=False)
        if not active:
            report.seconds = {**stage_t, "total": time.perf_counter() - t_start}
            raise SyncError("no engine could take the sync:\n  " + "\n  ".join(
                f"{o.engine}: {o.error}" for o in report.engines.values()), report)

        mode = self.settings.pause_mode
        t_pause = time.perf_counter()
        with timed("pause"):
            _, fails = self._each(active, lambda a: a.pause(mode or a.pause_modes[0]))
        paused = [a for a in active if a.engine_name not in fails]
        active = self._drop(report, active, fails, "pause", begun=False)
        try:
            self._transfer(model, version, name_map, report, active, timed)
        finally:
            with timed("resume"):
                _, fails = self._each(paused, _resume)
            report.pause_window = time.perf_counter() - t_pause
            for name, err in fails.items():
                log.warning("engine %s did not resume: %s", name, err)
            report.seconds = {**stage_t, "total": time.perf_counter() - t_start}
        committed = [o for o in report.engines.values() if o.ok]
        if committed:
            self.encoding.commit(version)
            self.last_version = version
        else:
            self.encoding.rollback()
        if not report.ok:
            msg = f"sync of version {version} failed for {len(report.failed)} of {len(report.engines)} engines:\n  " + \
                "\n  ".join(f"{o.engine} at {o.stage}: {o.error}" for o in report.engines.values() if not o.ok)
            if self.settings.failure_policy == "raise" or not committed:
                raise SyncError(msg, report)
            log.warning(msg)
        return report

    def _publish(self, model: Any, version: int, name_map: NameMap | None, report: SyncReport,
                 timed: Callable[[str], Any], t_start: float, stage_t: dict[str, float]) -> SyncReport:
        """Publish-only transports: no engine is paused or told anything; receivers pull."""
        self.encoding.begin(version)
        try:
            with timed("open"):
                self.transport.open([], version)
            self._stream(model, name_map, report, [], timed, publish=True)
            with timed("finish"):
                fails = self.transport.finish([])
            if fails:
                raise SyncError(f"publishing version {version} failed: {fails}", report)
        except BaseException:
            self.encoding.rollback()
            raise
        finally:
            report.seconds = {**stage_t, "total": time.perf_counter() - t_start}
        self.encoding.commit(version)
        self.last_version = version
        report.verified = True   # digests are in the published manifest; pullers check them
        return report

    def _transfer(self, model: Any, version: int, name_map: NameMap | None, report: SyncReport,
                  active: list[Adapter], timed: Callable[[str], Any]) -> None:
        r = self.resolved
        plan = {"transport": r.transport_cls.describe(r.transport_options),
                "encoding": r.encoding_cls.describe(r.encoding_options)}
        self.encoding.begin(version)
        begun: list[Adapter] = []
        try:
            with timed("begin"):
                _, fails = self._each(active, lambda a: a.begin(version, plan))
            begun = [a for a in active if a.engine_name not in fails]
            active = self._drop(report, active, fails, "begin", begun=False)
            with timed("open"):
                fails = self.transport.open(active, version)
            active = self._drop(report, active, fails, "open", begun=True)
            active = self._stream(model, name_map, report, active, timed)
            with timed("finish"):
                fails = self.transport.finish(active)
            active = self._drop(report, active, fails, "send", begun=True)
            with timed("verify"):
                got, fails = self._each(active, lambda a: a.end())
            for name, digests in got.items():
                if self.settings.verify and digests != report.digests:
                    bad = sorted(i for i in set(report.digests) | set(digests)
                                 if digests.get(i) != report.digests.get(i))
                    fails[name] = WeightSyncError(
                        f"digest mismatch in buckets {bad[:10]}: the engine holds different bytes "
                        f"than were sent; it was not moved to version {version}")
            active = self._drop(report, active, fails, "verify", begun=True)
            with timed("commit"):
                _, fails = self._each(active, lambda a: a.commit(version))
            active = self._drop(report, active, fails, "commit", begun=False)
            for a in active:
                report.engines[a.engine_name].version = version
            report.verified = bool(active) and self.settings.verify and len(active) == len(report.engines)
        except BaseException as e:
            for a in active:
                o = report.engines[a.engine_name]
                o.ok, o.stage, o.error = False, "send", f"sync aborted: {type(e).__name__}: {e}"
            self._each(begun, lambda a: a.abort())
            if not isinstance(e, (WeightSyncError, ValueError, TypeError)):
                self.encoding.rollback()   # push() never sees this sync's outcome: forget it here
                raise

    def _stream(self, model: Any, name_map: NameMap | None, report: SyncReport,
                active: list[Adapter], timed: Callable[[str], Any], publish: bool = False) -> list[Adapter]:
        """Export and encode bucket i+1 on a worker thread while bucket i is being sent; at most
        `max_inflight_buckets` payloads exist at once."""
        slots = threading.Semaphore(self.settings.max_inflight_buckets)
        q: queue.Queue = queue.Queue()
        stop = threading.Event()
        progress = _Progress(self.settings.progress, _model_bytes(model), report.version)
        alloc = getattr(self.transport, "alloc", None)
        changed = elements = 0

        def produce() -> None:
            try:
                it = self.exporter.buckets(model, name_map=name_map)
                while not stop.is_set():
                    slots.acquire()
                    with timed("export"):
                        bucket = next(it, None)
                    if bucket is None or stop.is_set():
                        break
                    with timed("encode"):
                        payload = self.encoding.encode(bucket, alloc)
                    q.put(payload)
                    del bucket, payload
            except BaseException as e:  # noqa: BLE001 - handed to the sending thread
                q.put(e)
                return
            q.put(_DONE)

        worker = threading.Thread(target=produce, name="ws-export", daemon=True)
        worker.start()
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                payload: Payload = item
                report.buckets += 1
                report.tensors += len(payload.specs)
                report.logical_bytes += payload.logical_bytes
                report.wire_bytes += payload.wire_bytes
                report.digests[payload.index] = payload.digest
                if "changed_elements" in payload.meta:   # delta encodings say how sparse it was
                    changed += int(payload.meta["changed_elements"])
                    elements += sum(s.numel for s in payload.specs)
                    report.density = changed / max(1, elements)
                if not (active or publish):
                    self.transport.discard(payload)      # every engine failed: stop exporting
                    break
                with timed("send"):
                    fails = self.transport.send(payload, active)
                active = self._drop(report, active, fails, "send", begun=True)
                progress.advance(payload.logical_bytes)
                del payload, item
                slots.release()
            if report.buckets == 0:
                raise ValueError("the model has no tensors to send")
        finally:
            stop.set()
            slots.release()
            while worker.is_alive() or not q.empty():   # payloads never sent give their buffers back
                try:
                    left = q.get(timeout=0.05)
                except queue.Empty:
                    continue
                if isinstance(left, Payload):
                    self.transport.discard(left)
                slots.release()
            worker.join()
            progress.close()
        return active


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
