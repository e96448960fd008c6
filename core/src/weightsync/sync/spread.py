"""A push that every trainer rank sends (`sync.senders: all`): no rank funnels the model.

Rank 0 runs the round as for one sender; where one sender would open, stream and finish, rank 0
hands every rank an order and each rank sends the buckets it owns (`Exporter.owned`). What each
sent comes back in one gather, and the engines are verified against the union of every rank's
digests. A rank that died or is still busy at the deadline breaks the gather and with it the
round: nothing is committed, and the trainer's group is not used again by the push. Orders and
results travel as JSON in tensors over the trainer's own group, never pickled."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from weightsync.config import EngineSpec
from weightsync.errors import SyncError, WeightSyncError
from weightsync.interfaces import Adapter, Member, NameMap, SharesRounds
from weightsync.sync.ranks import gather_json, rank, share_json
from weightsync.sync.report import SyncReport
from weightsync.sync.rounds import GroupRound
from weightsync.sync.stream import Stream

if TYPE_CHECKING:
    from weightsync.sync.pipeline import WeightSync

log = logging.getLogger("weightsync.sync.spread")

__all__ = ["RanksLost", "SpreadRound", "end_orders", "follow", "send_own"]


def _shares(a: Adapter) -> SharesRounds:
    """The assembly let only adapters that share rounds into a spread push."""
    assert isinstance(a, SharesRounds), a.name
    return a


class RanksLost(SyncError):
    """A trainer rank stopped during a spread push (its group's collectives broke)."""


def send_own(stream: Stream, model: Any, name_map: NameMap | None, engines: list[Adapter],
             version: int, mode: str, count: bool) -> dict[str, Any]:
    """One rank's part of a round (open, stream its own buckets, finish), as JSON for rank 0; an
    exception becomes `error`, since the other ranks wait in the gather that follows."""
    local = SyncReport(version=version)
    failed: dict[str, list[str]] = {}
    digests: dict[int, str] = {}
    me = rank()

    def drop(active: list[Adapter], fails: dict[str, BaseException], stage: str) -> list[Adapter]:
        for n, e in fails.items():
            failed.setdefault(n, [stage, f"trainer rank {me}: {e}"])
        return [a for a in active if a.engine_name not in fails]
    try:
        active = drop(engines, stream.transport.open(engines, version), "open")
        active = stream.run(model, name_map, local, active, drop, digests, mode=mode, count=count)
        drop(active, stream.transport.finish(active), "send")
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails the round
        log.warning("trainer rank %d: its part of the push failed", me, exc_info=True)
        return {"error": f"trainer rank {me}: {type(e).__name__}: {e}"}
    return {"digests": {str(i): d for i, d in digests.items()},
            "names": {str(i): n for i, n in stream.names.items()}, "failed": failed,
            "remarks": stream.transport.remarks(), "buckets": local.buckets,
            "tensors": local.tensors, "logical_bytes": local.logical_bytes,
            "wire_bytes": local.wire_bytes, "changed": stream.changed, "elements": stream.elements}


def gathered(result: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Every rank's result, within `timeout` seconds; a broken group (a rank died, or is still
    busy at the push's deadline) is `RanksLost`."""
    try:
        return gather_json(result, timeout)
    except RuntimeError as e:        # gloo / nccl: a peer closed its connection or timed out
        raise RanksLost(f"a trainer rank stopped during the push ({e}); nothing was committed",
                        None) from e


class SpreadRound(GroupRound):
    """A GroupRound whose sending stage runs on every rank (see the module docstring)."""

    def __init__(self, *args: Any, which: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.which = which           # "main" (the push's encoding) or "raw" (a catch-up pass)

    def _send(self, model: Any, name_map: NameMap | None, active: list[Adapter], mode: str,
              count: bool) -> list[Adapter] | None:
        clock, version, report = self.clock, self.report.version, self.report
        share_json({"op": "round", "mode": mode, "count": count, "encoding": self.which,
                    "left": clock.left(), "engines": [
                        {"name": a.engine_name, "spec": a.engine.model_dump(mode="json"),
                         "round": _shares(a).round_state()} for a in active]}, leader=True)
        mine = send_own(self.stream, model, name_map, active, version, mode, count)
        with clock.timed("gather"):
            try:
                everyone = gathered(mine, clock.left() + 5)
            except RanksLost as e:
                e.report = report
                raise
        errors = [r["error"] for r in everyone if "error" in r]
        if errors:
            raise SyncError("; ".join(errors), report)
        fails: dict[str, BaseException] = {}
        changed = elements = 0
        for r, got in enumerate(everyone):
            for i, d in got["digests"].items():
                if int(i) in self.digests:
                    raise SyncError(f"bucket {i} was sent by two trainer ranks; the exporter's "
                                    f"owners overlap", report)
                self.digests[int(i)] = d
            self.stream.names.update((int(i), n) for i, n in got["names"].items())
            for n, (stage, why) in got["failed"].items():
                fails.setdefault(n, WeightSyncError(f"{stage}: {why}"))
            for n, text in got["remarks"].items():
                if n in report.engines:
                    report.engines[n].remark = text
            report.wire_bytes += got["wire_bytes"]
            report.senders[r] = report.senders.get(r, 0) + got["wire_bytes"]
            if count:
                report.buckets += got["buckets"]
                report.tensors += got["tensors"]
                report.logical_bytes += got["logical_bytes"]
            changed, elements = changed + got["changed"], elements + got["elements"]
        if count and elements:
            report.density = changed / elements
        return self.drop(active, fails, "send")


def follow(sync: "WeightSync", model: Any, version: int, name_map: NameMap | None,
           stream: Callable[[Any], Stream]) -> None:
    """A rank other than 0 in a spread push: run rank 0's orders (a round's sending stage each)
    until it says done, then commit or roll back the encoding as rank 0 did."""
    begun, first = False, True
    try:
        while True:
            # the first order waits for rank 0 to call push at all; later ones, a push at most
            order = share_json(leader=False, timeout=None if first else sync.settings.deadline)
            first = False
            if order["op"] == "done":
                break
            encoding = sync.encoding if order["encoding"] == "main" else sync._raw()
            if order["encoding"] == "main" and not begun:
                encoding.begin(version)
                begun = True
            deadline = time.monotonic() + float(order["left"])
            engines, broken = [], {}
            for e in order["engines"]:
                try:
                    a = sync._adapter(Member(e["name"], EngineSpec.model_validate(e["spec"])))
                    a.deadline, a.lease = deadline, sync.settings.lease
                    _shares(a).join_round(e["round"])
                    engines.append(a)
                except Exception as err:  # noqa: BLE001 - that engine fails; this rank exports on
                    broken[e["name"]] = ["open", f"trainer rank {rank()}: {err}"]
            sync.transport.deadline = deadline
            result = send_own(stream(encoding), model, name_map, engines, version, order["mode"],
                              order["count"])
            if "failed" in result:
                result["failed"].update(broken)
            gathered(result, deadline - time.monotonic() + 5)
    except RuntimeError as e:
        raise RanksLost(f"trainer rank 0 or another rank stopped during the push ({e})", None) from e
    if begun:
        if order.get("commit"):
            sync.encoding.commit(version)
        else:
            sync.encoding.rollback()


def end_orders(commit: bool) -> None:
    """Rank 0: no more rounds this push (followers commit the encoding when `commit`)."""
    share_json({"op": "done", "commit": commit}, leader=True)

