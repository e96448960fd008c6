"""WeightSync: runs one sync. It only orchestrates: which engines, in which order, what to do when
one fails. Endpoints live in adapters, bytes in encodings, carrying in transports, the steps of
one round in `rounds`, the data path in `stream`."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping


from weightsync.sync.assembly import (ResolvedConfig, check_pause_mode, check_senders, plan_engine,
                                      resolve)
from weightsync.sync.peer_join import PeerCatchUp
from weightsync.config import ComponentRef, SyncConfig
from weightsync.errors import ConfigError, SyncError, WeightSyncError
from weightsync.interfaces import Adapter, Encoding, Member, NameMap
from weightsync.plugins import Components, load_components
from weightsync.sync.probe import join_probe, run_probe
from weightsync.sync.ranks import is_follower, share_int, share_report, world
from weightsync.sync.report import EngineOutcome, SyncReport, held_by_most
from weightsync.sync.rounds import Calls, Clock, GroupRound, Renewer
from weightsync.sync.spread import RanksLost, SpreadRound, end_orders, follow
from weightsync.sync.stream import Stream

log = logging.getLogger("weightsync.sync.pipeline")


class WeightSync:
    """The pipeline assembled from a SyncConfig. `push(model, version=v)` is the trainer's one call."""

    def __init__(self, resolved: ResolvedConfig, components: Components) -> None:
        self.resolved, self.components = resolved, components
        self.settings = resolved.config.sync
        r = resolved
        self.exporter = r.exporter_cls(r.exporter_options)
        self.encoding = r.encoding_cls(r.encoding_options)
        self.transport = r.transport_cls(r.transport_options)
        self._adapters: dict[str, tuple[str, Adapter]] = {}
        for p in r.engines:
            self._adapters[p.spec.name or p.spec.url] = (p.spec.model_dump_json(),
                                                         p.adapter_cls(p.adapter_options, p.spec))
        self.fleet = r.fleet_cls(r.fleet_options, engines=[p.spec for p in r.engines])
        self.fleet.open(components, resolved.config.adapter)
        self.last_version: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="ws-ctl")
        self._catch_up: Encoding | None = None
        self._last_members: set[str] | None = None
        self._probe_model: Any = None         # this push's: what the probe runs (`probe_with`)
        self._passes = self._passes_run = 0   # exporter passes announced / run (rank 0's count)
        from weightsync.sync.metrics import Metrics
        from weightsync.wire.signing import load_key
        self._key = load_key(None, self.settings.hmac_key_file)
        self.metrics = Metrics(self.settings.metrics)

    @classmethod
    def from_config(cls, source: "str | Path | Mapping[str, Any] | SyncConfig", *,
                    components: Components | None = None) -> "WeightSync":
        components = components or load_components()
        return cls(resolve(SyncConfig.load(source), components), components)

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def preflight(self) -> list[str]:
        """Every engine's health, version and access, asked before the trainer spends minutes
        loading a model: a wrong URL or key fails here (ConfigError), not at the first push."""
        from weightsync.sync.check import contact
        problems, lines = contact(self)
        if problems:
            raise ConfigError("the fleet is not ready for a push:\n  " + "\n  ".join(problems))
        return lines

    def close(self) -> None:
        self.transport.close()
        for _, a in self._adapters.values():
            a.close()
        self.fleet.close()
        self.metrics.close()
        self._pool.shutdown(wait=False)

    @property
    def adapters(self) -> list[Adapter]:
        """The adapters of the members seen so far (the config's engines for a static fleet)."""
        return [a for _, a in self._adapters.values()]

    @property
    def fleet_url(self) -> str | None:
        """Where members register, for a registry fleet."""
        return getattr(self.fleet, "url", None)

    def record_gap(self, engine: str, version: int, mean: float, max_: float) -> None:
        """Record the train–inference gap of rollouts (metrics file and Prometheus)."""
        self.metrics.record_gap(engine, version, mean, max_)
    def fleet_version(self) -> int | None:
        """The newest version the fleet holds (None: nothing pushed yet): what a restarted trainer
        pushes above. A fleet that records its pushes says it; else what a strict majority of
        the engines hold (`held_by_most`: one member claiming 2**63 cannot set everyone's next)."""
        recorded = getattr(self.fleet, "version", None)
        if callable(recorded) and (got := recorded()) is not None:
            return int(got)
        engines = self.members()
        clock = Clock(self.settings.deadline)
        self._bound(engines, clock)
        statuses, _ = Calls(self._pool, clock).each(engines, lambda a: a.health())
        return held_by_most([s.version for s in statuses.values()])

    def _adapter(self, m: Member) -> Adapter:
        key = m.spec.model_dump_json()
        hit = self._adapters.get(m.name)
        if hit is not None and hit[0] == key:
            return hit[1]
        r = self.resolved
        plan = plan_engine(m.spec, r.config.adapter, r.transport_cls, r.encoding_cls, self.components)
        check_pause_mode(self.settings.pause_mode, plan.adapter_cls)
        check_senders(self.settings.senders, plan.adapter_cls, r.transport_cls, r.exporter_cls,
                      self.components)
        if hit is not None:
            hit[1].close()
        a = plan.adapter_cls(plan.adapter_options, plan.spec)
        self._adapters[m.name] = (key, a)
        return a

    def members(self, report: SyncReport | None = None) -> list[Adapter]:
        """The engines this push must reach (the fleet's live members); with `report`, who
        joined, left and was excluded is written into it."""
        out: list[Adapter] = []
        excluded = dict(self.fleet.excluded())
        for m in self.fleet.members():
            try:
                out.append(self._adapter(m))
            except WeightSyncError as e:       # an adapter that cannot take this transport
                excluded[m.name] = str(e)
        if report is not None:
            names = {a.engine_name for a in out}
            if self._last_members is not None:
                report.joined = sorted(names - self._last_members)
                report.left = sorted(self._last_members - names - set(excluded))
            report.excluded = excluded
            self._last_members = names
        return out

    # -- the sync ----------------------------------------------------------------------------
    def push(self, model: Any, version: int, *, name_map: NameMap | None = None,
             probe_with: Any = None) -> SyncReport:
        """Send `model` to every engine as weight version `version`; verify; return the report
        (SyncError with `.report` when an engine did not end at `version`). `probe_with`: the
        causal LM the probe runs when `model` is not one (a state dict taken from it)."""
        self._probe_model = probe_with if probe_with is not None else model
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"version {version} is not newer than the last pushed version "
                             f"{self.last_version}; versions must grow with every sync")
        try:
            report = (self._follow if is_follower() else self._lead)(model, version, name_map)
        except SyncError as e:                # no engine could take it: still logged and counted
            if isinstance(e.report, SyncReport):
                self._record(e.report)
            raise
        self._record(report)
        log.debug("push v%d stages: %s", version, {k: round(v, 4) for k, v in report.seconds.items()})
        if not report.ok:
            msg = (f"sync of version {version} failed for {len(report.failed)} of "
                   f"{len(report.engines)} engines:\n  " + "\n  ".join(
                       f"{o.engine} at {o.stage}: {o.error}" for o in report.engines.values() if not o.ok))
            if self.settings.failure_policy == "raise" or not any(o.ok for o in report.engines.values()):
                raise SyncError(msg, report)
            log.warning(msg)
        return report

    def _record(self, report: SyncReport) -> None:
        log.info("%s", report.summary().splitlines()[0])
        self.metrics.record(report)

    def _follow(self, model: Any, version: int, name_map: NameMap | None) -> SyncReport:
        """A rank other than 0: the exporter passes rank 0 announces (gathers are collectives
        every rank joins), or a spread push's orders; the probe's forward; rank 0's report."""
        if self.spread:
            follow(self, model, version, name_map, self._stream)
        else:
            for _ in range(share_int(None)):
                for _ in self.exporter.buckets(model, name_map=name_map):
                    pass
        if share_int(None):                   # rank 0 probes: a sharded forward needs every rank
            join_probe(self._probe_model, self.settings.probe)
        report = share_report(None)
        if any(o.ok for o in report.engines.values()) or report.published:
            self.last_version = version
        return report

    def _lead(self, model: Any, version: int, name_map: NameMap | None) -> SyncReport:
        """Rank 0 (or a single-process trainer): run the sync; share the report with followers."""
        report = SyncReport(version=version)
        clock = Clock(self.settings.deadline)
        self._announced, self._passes, self._passes_run = False, 0, 0
        self._probing: bool | None = None      # told the followers whether they join the probe
        self._anchor: list[list[Any]] = []     # [[names], digest] per bucket of this push
        self._committed, self._ordered, lost = False, False, False
        try:
            if self.transport.publish_only:
                self._announce(1)
                self._publish(model, version, name_map, report, clock)
            else:
                self._sync(model, version, name_map, report, clock)
        except RanksLost:
            lost = True                        # the group is broken: no collective can follow
            raise
        finally:
            report.seconds = {**clock.stages, "total": clock.since()}
            if world() is not None and not lost:
                self._drain(model, name_map)
                if self._probing is None:
                    share_int(0)
                share_report(report)
        return report

    @property
    def spread(self) -> bool:
        """Every rank sends its own buckets this push (`senders: all` in a multi-rank trainer)."""
        return self.settings.senders == "all" and world() is not None

    def _announce(self, passes: int) -> None:
        """Tell follower ranks how many exporter passes this push runs (once per push)."""
        if self.spread:
            return                             # followers take orders instead (`spread.py`)
        if world() is not None and not self._announced:
            share_int(passes)
            self._passes = passes
        self._announced = True

    def _pass_started(self) -> None:
        self._passes_run += 1

    def _drain(self, model: Any, name_map: NameMap | None) -> None:
        """The exporter passes rank 0 announced and did not run (a failure between the
        announcement and a pass, a catch-up that was not needed): the followers are gathering
        already, so rank 0 runs them too. A spread push tells them it has no more orders."""
        if self.spread:
            if not self._ordered:
                self._ordered = True
                end_orders(self._committed)
            return
        self._announce(0)
        for _ in range(self._passes - self._passes_run):
            self._passes_run += 1
            for _ in self.exporter.buckets(model, name_map=name_map):
                pass

    def _join_probe(self, model: Any, name_map: NameMap | None) -> None:
        """Rank 0 is about to run the probe's forward pass: the followers run it with it."""
        if world() is not None:
            self._drain(model, name_map)
            share_int(1)
            self._probing = True

    def _bound(self, adapters: list[Adapter], clock: Clock) -> None:
        for a in adapters:
            a.deadline, a.lease = clock.deadline, self.settings.lease
        self.transport.deadline = clock.sending

    def _sync(self, model: Any, version: int, name_map: NameMap | None, report: SyncReport,
              clock: Clock) -> None:
        engines = self.members(report)
        self._bound(engines, clock)
        calls = Calls(self._pool, clock)
        with clock.timed("health"):
            statuses, fails = calls.each(engines, lambda a: a.health())
        for a in engines:
            st = statuses.get(a.engine_name)
            report.engines[a.engine_name] = EngineOutcome(a.engine_name, True, st.version if st else None)
            if st is not None and st.version >= version:
                fails[a.engine_name] = WeightSyncError(
                    f"engine is already at version {st.version}; push a version above it")
        for name, err in fails.items():
            report.engines[name].fail("health", str(err))
            report.engines[name].seconds = clock.since()
        live = [a for a in engines if a.engine_name not in fails]
        if not live:
            why = [f"{o.engine}: {o.error}" for o in report.engines.values()]
            why += [f"{n}: excluded: {e}" for n, e in report.excluded.items()]
            raise SyncError("no engine could take the sync:\n  " + "\n  ".join(
                why or ["the fleet has no members: no engine is registered or listed"]), report)

        self.encoding.begin(version)
        base = self.encoding.base()
        main = [a for a in live if base is None or statuses[a.engine_name].version == base]
        behind = [a for a in live if a not in main]
        self._announce(2 if behind else 1)
        renewer = Renewer(self.settings.lease)
        try:
            done = self._round(self.encoding, main, model, name_map, report, clock, calls, renewer,
                               mode="engines" if main else "encode")
        except BaseException:
            self.encoding.rollback()
            renewer.close()
            raise
        if done or (not main and behind):
            self.encoding.commit(version)   # the encoding's base moves on with the engines
            self._committed = True
        else:
            self.encoding.rollback()
        try:
            if behind and done:             # relay shapes: from a peer that holds this version
                behind = PeerCatchUp(self.transport, calls, clock, report,
                                     self.settings.verify).run(behind, done, self._anchor)
            if behind:                      # whole tensors for engines that lack the base
                log.info("catching up %s (at versions %s) with whole tensors",
                         [a.engine_name for a in behind],
                         [statuses[a.engine_name].version for a in behind])
                self._round(self._raw(), behind, model, name_map, report, clock, calls, renewer,
                            caught_up=True, count=not main)
        finally:
            renewer.close()
        with clock.timed("probe"):
            run_probe(self._probe_model, version, live, report, self.settings.probe, calls.each,
                      lambda: self._join_probe(model, name_map))
        if any(o.ok for o in report.engines.values()):
            self.last_version = version
        report.verified = bool(report.engines) and all(o.status == "verified"
                                                       for o in report.engines.values())
        self._tell_fleet(version, report)

    def _tell_fleet(self, version: int, report: SyncReport) -> None:
        """The fleet hears what each engine holds (peer-join fleets: the anchor); failing only warns."""
        try:
            anchor = getattr(self.fleet, "anchor", None)
            if anchor is not None and self._anchor and any(o.ok for o in report.engines.values()):
                anchor(version, self._anchor)
            self.fleet.synced(version, report.versions())
        except WeightSyncError as e:
            log.warning("telling the fleet about version %d failed: %s", version, e)

    def _raw(self) -> Encoding:
        if self._catch_up is None:
            cls = self.components.encodings.get("raw")
            self._catch_up = cls(cls.Options())
        return self._catch_up

    def _round(self, encoding: Encoding, engines: list[Adapter], model: Any,
               name_map: NameMap | None, report: SyncReport, clock: Clock, calls: Calls,
               renewer: Renewer, *, mode: str = "engines", caught_up: bool = False,
               count: bool = True) -> list[Adapter]:
        r = self.resolved
        plan = {"transport": r.transport_cls.describe(r.transport_options),
                "encoding": (r.encoding_cls.describe(r.encoding_options) if encoding is self.encoding
                             else ComponentRef(kind=encoding.name).model_dump())}
        stream = self._stream(encoding, clock.timed)
        args = (self.settings, stream, encoding, self.transport, plan, calls, clock, report, renewer)
        rnd = (SpreadRound(*args, caught_up=caught_up,
                           which="main" if encoding is self.encoding else "raw")
               if self.spread else GroupRound(*args, caught_up=caught_up))
        done = rnd.run(model, name_map, engines, mode=mode, count=count)
        if count:
            report.digests = dict(rnd.digests)
            self._anchor = [[stream.names.get(i, []), d] for i, d in sorted(rnd.digests.items())]
        return done

    def _stream(self, encoding: Encoding, timed: Any = None) -> Stream:
        """The data path of one round (a spread push's: this rank's own buckets)."""
        return Stream(self.exporter, encoding, self.transport, self.settings.max_inflight_buckets,
                      self.settings.progress, timed or Clock(self.settings.deadline).timed,
                      self._key, self._pass_started, spread=self.spread)

    def _publish(self, model: Any, version: int, name_map: NameMap | None, report: SyncReport,
                 clock: Clock) -> None:
        """Publish-only transports: no engine is paused or told anything; receivers pull and
        check every digest themselves, so the report says published, not verified."""
        self.transport.deadline = clock.deadline
        self.encoding.begin(version)
        try:
            with clock.timed("open"):
                self.transport.open([], version)
            stream = self._stream(self.encoding, clock.timed)
            stream.run(model, name_map, report, [], lambda a, f, s: a, report.digests, mode="publish")
            with clock.timed("finish"):
                fails = self.transport.finish([])
            if fails:
                raise SyncError(f"publishing version {version} failed: {fails}", report)
        except BaseException:
            self.encoding.rollback()
            raise
        self.encoding.commit(version)
        self.last_version = version
        report.published = True
        self._tell_fleet(version, report)


__all__ = ["WeightSync"]

