"""Transport `collective`: a torch.distributed broadcast from the trainer (rank 0) to every engine
rank, for disaggregated clusters. The group is SGLang's `init_custom_process_group` recipe (TCP
store + PrefixStore(group name) + a gloo or nccl group), so SGLang and LMDeploy engines join it
through their own HTTP routes and weightsync's receivers join it the same way.

Contract (fixed in COLLECTIVE_SPEC): one broadcast per bucket of flattened bytes, never one per
tensor; what is broadcast depends on the engines' `Adapter.layout` ("safetensors": the whole
body; "flat": its data section; "flat_per_dtype": one broadcast per run of one dtype). For every
broadcast each engine's `announce(header)` runs on its own thread while rank 0 broadcasts.

Why the failure handling looks the way it does: a gloo broadcast to a peer that died fails at
rank 0 at once, but the surviving ranks wait for data that never comes. So when a broadcast fails
the transport asks every engine for its health, drops the dead ones, rebuilds the group for the
survivors under a new group name (a stale rank can never join it) and broadcasts the same bytes
again. An engine that never joins makes the group creation time out after `timeout` seconds: the
engines that did not answer are dropped and the group is built once more without them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..bucket import dtype_from_name
from ..errors import ConfigError, PayloadError, TransportError
from ..interfaces import Adapter, Payload, Transport, TransportReceiver
from . import pg as pgs

log = logging.getLogger(__name__)
LAYOUTS = ("safetensors", "flat", "flat_per_dtype")


class CollectiveOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    master_address: str = Field("127.0.0.1", description="address engines reach the trainer's store at")
    master_port: int = Field(0, ge=0, le=65535, description="store port; 0 picks a free one")
    group_name: str = Field("weightsync", min_length=1, description="prefix of the group's name")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto: nccl when CUDA is available, else gloo")
    timeout: float = Field(120.0, gt=0, description="seconds a join or one broadcast may take")
    buffers: int = Field(2, ge=1, le=8, description="send buffers used in turn: the exporter "
                                                    "fills one while the other is broadcast")


# -- receiving side ---------------------------------------------------------------------------
_BUILDS = itertools.count(1)
_GROUPS: dict[str, tuple[pgs.Group, "_Order"]] = {}
_GROUPS_LOCK = threading.Lock()


class _Order:
    """Broadcasts on one group must be received in the sender's order, but the announces that
    trigger them are HTTP requests that may arrive out of order (the trainer keeps one in flight
    while it broadcasts the next). Each announce carries `seq`; a receive waits for its turn."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.next = 0
        self.dead = False          # the group was left: announces still waiting give up

    def wait_turn(self, seq: int | None, timeout: float) -> None:
        if seq is None:
            return
        with self.cond:
            if not self.cond.wait_for(lambda: self.next >= seq or self.dead, timeout):
                raise TransportError(f"broadcast {seq} was announced, but broadcast {self.next} "
                                     f"never arrived within {timeout}s")
            if self.dead:
                raise TransportError(f"broadcast {seq} was announced on a group this engine has "
                                     f"left (the trainer rebuilt it); the trainer announces it again")
            if self.next > seq:
                raise PayloadError(f"broadcast {seq} was announced twice")

    def end(self) -> None:
        with self.cond:
            self.dead = True
            self.cond.notify_all()

    def done(self, seq: int | None) -> None:
        if seq is None:
            return
        with self.cond:
            self.next = seq + 1
            self.cond.notify_all()


def _forget_groups() -> None:
    """Leave every group this process is in (a process follows one trainer at a time)."""
    with _GROUPS_LOCK:
        old = [g for g, _ in _GROUPS.values()]
        orders = [o for _, o in _GROUPS.values()]
        _GROUPS.clear()
    for o in orders:
        o.end()
    for g in old:
        pgs.forget(g.pg)
        # a group whose peer died may block in shutdown: never on the caller's thread
        threading.Thread(target=pgs.shutdown, args=(g.pg,), daemon=True, name="ws-pg-destroy").start()


class _RecvPool:
    """Receive buffers reused across buckets and rounds (per process), so a broadcast lands in
    warm memory instead of page-faulting a fresh allocation every bucket."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def take(self, nbytes: int, device: Any) -> torch.Tensor:
        with self.lock:
            fits = [i for i, b in enumerate(self.free)
                    if b.numel() >= nbytes and b.device == torch.device(device)]
            if fits:
                return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
            if len(self.free) >= 3:          # keep at most three idle buffers (one bucket
                                             # staging, one arriving, one announced ahead)
                self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].numel()))
        return torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)

    def give(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.free.append(buf)


_POOL = _RecvPool()


class CollectiveReceiver(TransportReceiver):
    """Joins the trainer's group (per process: the group outlives one update round, because a
    new round does not rebuild it) and receives one broadcast per announce."""

    private = True      # a broadcast lands in this process's own receive buffers

    def __init__(self, options: BaseModel) -> None:
        super().__init__(options)
        self._lent: dict[tuple[Any, int], torch.Tensor] = {}

    def join(self, info: Mapping[str, Any]) -> None:
        try:
            name = str(info["group_name"])
            rank = int(info["rank_offset"])            # + local TP rank: the reference engine has 1
            world = int(info["world_size"])
            backend = str(info.get("backend") or "gloo")
            address, port = str(info["master_address"]), int(info["master_port"])
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"group info is malformed ({e}); expected master_address, "
                               f"master_port, rank_offset, world_size, group_name, backend") from None
        if not 0 < rank < world:
            raise PayloadError(f"rank_offset {rank} is outside 1..{world - 1} for world_size {world}")
        timeout = self.options.timeout
        _forget_groups()
        store = pgs.make_store(address, port, world, False, timeout)
        try:
            pg = pgs.new_group(store, name, rank, world, backend, timeout)
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/DistError/ValueError
            raise TransportError(f"could not join group {name!r} at {address}:{port} as rank "
                                  f"{rank} of {world} within {timeout}s: {e}") from None
        with _GROUPS_LOCK:
            _GROUPS[name] = (pgs.Group(name, pg, store, rank, world, backend), _Order())

    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        tr = header.get("transport") or {}
        name = tr.get("group_name")
        layout = tr.get("layout", "safetensors")
        if layout != "safetensors":
            raise PayloadError(f"weightsync's receiver takes layout 'safetensors', not {layout!r}")
        with _GROUPS_LOCK:
            entry = _GROUPS.get(name)
        if entry is None:
            raise PayloadError(f"this engine is not in group {name!r}; the trainer must make it "
                               f"join (/weightsync/join) before announcing broadcasts")
        group, order = entry
        nbytes = int(tr["nbytes"])
        seq = int(tr["seq"]) if "seq" in tr else None
        device = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else "cpu"
        order.wait_turn(seq, self.options.timeout)      # an announce made ahead waits here
        whole = _POOL.take(nbytes, device)
        buf = whole[:nbytes]
        try:
            try:
                pgs.broadcast(group.pg, buf, self.options.timeout)
            finally:
                order.done(seq)
        except BaseException:
            _POOL.give(whole)
            raise
        self._lent[(name, int(header.get("index", -1)))] = whole
        return buf

    def release(self, header: Mapping[str, Any]) -> None:
        """The engine staged the bucket: its receive buffer serves the next one."""
        tr = header.get("transport") or {}
        whole = self._lent.pop((tr.get("group_name"), int(header.get("index", -1))), None)
        if whole is not None:
            _POOL.give(whole)


# -- sending side -----------------------------------------------------------------------------
class _Buffer:
    """One reusable send buffer: payloads are packed straight into it (warm memory, no
    allocation per bucket) and it is handed out again once its broadcast is done."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.free = threading.Event()
        self.free.set()

    def holds(self, t: torch.Tensor) -> bool:
        b = self.tensor
        return (b is not None and b.device == t.device and b.data_ptr() <= t.data_ptr()
                and t.data_ptr() + t.numel() <= b.data_ptr() + b.numel())


@dataclass
class _Piece:
    """One broadcast: a tensor and the transport fields of its announce header."""

    tensor: torch.Tensor
    fields: dict[str, Any]


@dataclass
class _Ahead:
    """The announces of a payload made while the previous bucket was still being broadcast."""

    group: str
    seq: int
    engines: tuple[str, ...]
    calls: dict[str, "_Call"]
    wake: threading.Event


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


def body_layout(body: torch.Tensor) -> tuple[int, list[tuple[str, str, list[int], int, int]]]:
    """Start of the data section and (name, dtype, shape, start, end) per tensor in wire order,
    read from the payload's own safetensors header."""
    from ..wire import _ST_NAMES, read_header
    start, entries, _ = read_header(body)
    out = [(n, _ST_NAMES[v["dtype"]], list(v["shape"]), int(v["data_offsets"][0]), int(v["data_offsets"][1]))
           for n, v in entries.items()]
    return start, out


def split_payload(body: torch.Tensor, layout: str) -> list[tuple[torch.Tensor, str, list[dict[str, Any]]]]:
    """(tensor to broadcast, its dtype name, tensors it carries) for one payload and layout."""
    start, tensors = body_layout(body)
    specs = [{"name": n, "dtype": d, "shape": s} for n, d, s, _, _ in tensors]
    if layout == "safetensors":
        return [(body, "uint8", specs)]
    data = body[start:]
    if layout == "flat":
        return [(data, "uint8", specs)]
    runs: list[tuple[torch.Tensor, str, list[dict[str, Any]]]] = []
    i = 0
    while i < len(tensors):
        j = i
        while j < len(tensors) and tensors[j][1] == tensors[i][1]:
            j += 1
        a, b = tensors[i][3], tensors[j - 1][4]
        dt = tensors[i][1]
        runs.append((data[a:b].view(dtype_from_name(dt)), dt, specs[i:j]))
        i = j
    return runs


class CollectiveTransport(Transport):
    name = "collective"
    Options = CollectiveOptions
    requires = "group"
    receiver = CollectiveReceiver

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self.group: pgs.Group | None = None
        self.infos: dict[str, dict[str, Any]] = {}
        self.key: tuple | None = None
        self.backend = self.options.backend if self.options.backend != "auto" else pgs.default_backend()
        self.pending: list[tuple[dict[str, _Call], int]] = []   # announces of the previous broadcast
        self._seq = 0                                             # broadcasts on the current group
        self._members: dict[str, Adapter] = {}
        self._ring = [_Buffer() for _ in range(self.options.buffers)]
        self._turn = 0
        self._ring_lock = threading.Lock()
        # announces made ahead (`announce_ahead`): by payload index, with the seq they carry
        self._ahead: dict[int, _Ahead] = {}
        self._ahead_seq = 0          # the seq the next announce made ahead carries
        self._ahead_next = -1        # the payload index that may be announced ahead next
        self._ahead_lock = threading.Lock()

    def alloc(self, nbytes: int) -> torch.Tensor:
        """The next send buffer, once its previous broadcast is done; grown when too small.
        Sender memory stays at `buffers` buckets whatever the model size."""
        with self._ring_lock:
            buf = self._ring[self._turn]
            self._turn = (self._turn + 1) % len(self._ring)
        if not buf.free.wait(self.options.timeout):
            raise TransportError(f"no send buffer was released within {self.options.timeout}s")
        buf.free.clear()
        if buf.tensor is None or buf.tensor.numel() < nbytes:
            buf.tensor = None
            device = "cuda" if self.backend == "nccl" else "cpu"
            buf.tensor = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)
        return buf.tensor[:nbytes]

    def _release(self, body: torch.Tensor) -> None:
        for b in self._ring:
            if b.holds(body):
                b.free.set()

    # -- group lifecycle ------------------------------------------------------------------
    @staticmethod
    def _layout(engines: Sequence[Adapter]) -> str:
        layouts = {a.layout for a in engines}
        if len(layouts) > 1:
            raise ConfigError(f"engines in one collective group must share a broadcast layout, got "
                              f"{sorted(layouts)}; run engines of different kinds in separate syncs")
        layout = next(iter(layouts), "safetensors")
        if layout not in LAYOUTS:
            raise ConfigError(f"adapter layout {layout!r} is unknown to transport 'collective'; "
                              f"known: {list(LAYOUTS)}")
        return layout

    def _destroy(self) -> None:
        if self.group is None:
            return
        for a in self._members.values():
            try:
                a.leave_group(self.infos.get(a.engine_name, {}))
            except Exception as e:  # noqa: BLE001 - best effort by contract
                log.debug("engine %s did not leave group: %s", a.engine_name, e)
        g, self.group, self.key = self.group, None, None
        pgs.forget(g.pg)
        threading.Thread(target=pgs.shutdown, args=(g.pg,), daemon=True, name="ws-pg-destroy").start()

    def _build(self, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        """A fresh group for `engines`; returns the engines that could not join."""
        self._destroy()
        o = self.options
        name = f"{o.group_name}_{next(_BUILDS)}"   # unique per process: a stale rank cannot join
        world = 1 + sum(a.group_size() for a in engines)
        store = pgs.make_store(o.master_address, o.master_port, world, True, o.timeout)
        port = store.port
        infos, offset = {}, 1
        for a in engines:
            infos[a.engine_name] = {"master_address": o.master_address, "master_port": port,
                                    "rank_offset": offset, "world_size": world,
                                    "group_name": name, "backend": self.backend}
            offset += a.group_size()
        calls = {a.engine_name: _spawn(a.join_group, infos[a.engine_name]) for a in engines}
        try:
            pg = pgs.new_group(store, name, 0, world, self.backend, o.timeout)
        except Exception as e:  # noqa: BLE001 - turned into per-engine failures below
            return self._join_failures(engines, calls, infos, name, world, e)
        fails = {}
        for a in engines:
            c = calls[a.engine_name]
            if not c.done(o.timeout) or c.error:
                fails[a.engine_name] = c.error[0] if c.error else TransportError(
                    f"engine did not confirm joining group {name!r} within {o.timeout}s")
        self.group = pgs.Group(name, pg, store, 0, world, self.backend)
        self._seq = 0
        self.infos = infos
        self._members = {a.engine_name: a for a in engines}
        self.key = tuple((a.engine_name, a.group_size()) for a in engines)
        if fails:   # a member that did not confirm poisons the group: rebuild without it next time
            self.key = None
        return fails

    def _join_failures(self, engines: Sequence[Adapter], calls: dict[str, _Call],
                       infos: dict[str, dict[str, Any]], name: str, world: int,
                       err: BaseException) -> dict[str, BaseException]:
        """Rank 0 gave up on the group. The engines that joined fail right after it (they waited
        for the same missing rank), so the culprits are the calls still running after a grace
        period; failing that, the calls that failed on their own (dead engine, refused)."""
        deadline = time.monotonic() + max(1.0, min(10.0, self.options.timeout))
        pending = [a for a in engines if not calls[a.engine_name].done(max(0.0, deadline - time.monotonic()))]
        log.info("group %r was not formed: %s", name, err)
        if pending:
            return {a.engine_name: TransportError(
                f"engine did not join collective group {name!r} within {self.options.timeout}s "
                f"(rank {infos[a.engine_name]['rank_offset']} of {world}); it was left out "
                f"(rank 0: {str(err).splitlines()[0][:200]})")
                for a in pending}
        errs = {a.engine_name: calls[a.engine_name].error[0] for a in engines
                if calls[a.engine_name].error and not _is_timeout(calls[a.engine_name].error[0])}
        return errs or {a.engine_name: TransportError(f"group {name!r} could not be formed: {err}")
                        for a in engines}

    def _ensure(self, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        """The group for exactly `engines`, rebuilt when the set changed. Engines that cannot join
        are dropped and the group is built once more for the others."""
        key = tuple((a.engine_name, a.group_size()) for a in engines)
        if self.group is not None and self.key == key:
            return {}
        failures: dict[str, BaseException] = {}
        members = list(engines)
        for _ in range(2):
            fails = self._build(members)
            failures.update(fails)
            members = [a for a in members if a.engine_name not in fails]
            if not fails or not members:
                break
        if failures and members and self.key is None:
            self._destroy()
        return failures

    def open(self, engines: Sequence[Adapter], version: int) -> dict[str, BaseException]:
        with self._ring_lock:       # buffers of an aborted sync were never sent: all free again
            self._turn = 0
            for b in self._ring:
                b.free.set()
        self._forget_ahead()
        self._layout(engines)
        if not engines:
            return {}
        fails = self._ensure(engines)
        with self._ahead_lock:
            self._ahead_seq, self._ahead_next = self._seq, 0
        return fails

    # -- announcing ahead ---------------------------------------------------------------------
    def announce_ahead(self, payload: Payload, engines: Sequence[Adapter]) -> None:
        """Announce `payload` as soon as it is packed, while the bucket before it is still being
        broadcast, so every engine has posted its receive when rank 0 starts the next broadcast
        (no idle link between buckets: an announce costs an HTTP round trip and a gloo
        handshake). Only for engines that serve announces in any order and wait for their turn
        (`ordered_announces`), the whole body as one broadcast, payloads announced in bucket
        order on the group `open` built for exactly these engines; otherwise `send` announces
        as before. An announce that is never broadcast (an aborted round, a rebuilt group)
        leaves its group poisoned: the next round builds a new one, which frees the engines
        still waiting on the old one."""
        engines = list(engines)
        group = self.group          # the sending thread may be replacing it: one look
        with self._ahead_lock:
            try:
                fits = (payload.index == self._ahead_next and group is not None and bool(engines)
                        and all(a.ordered_announces for a in engines)
                        and self.key == tuple((a.engine_name, a.group_size()) for a in engines)
                        and self._layout(engines) == "safetensors")
            except Exception:  # noqa: BLE001 - send announces it then, and reports what is wrong
                fits = False
            if not fits:
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
            calls = {a.engine_name: _spawn(a.announce, header, wake=wake) for a in engines}
            self._ahead[payload.index] = _Ahead(group.name, seq, tuple(a.engine_name for a in engines),
                                                calls, wake)

    def _take_ahead(self, payload: Payload, engines: Sequence[Adapter]) -> _Ahead | None:
        """The announces made ahead for `payload`, if they still fit the group and this seq;
        stale ones poison the group (their engines wait for a broadcast that never comes)."""
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
        """(`_ahead_lock` held) An announce made ahead that will never be broadcast: no more
        announcing ahead this round, and if it went to the current group, its engines wait for
        that seq, so the group must be rebuilt."""
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

    # -- sending ----------------------------------------------------------------------------
    def _device(self, t: torch.Tensor) -> torch.Tensor:
        if self.backend == "nccl" and not t.is_cuda:
            return t.cuda(non_blocking=False)
        if self.backend == "gloo" and t.device.type != "cpu":
            return t.cpu()
        return t

    def _collect(self, calls: dict[str, _Call], wait: float) -> dict[str, BaseException]:
        fails: dict[str, BaseException] = {}
        for name, c in calls.items():
            if not c.done(wait):
                fails[name] = TransportError(f"engine did not finish loading a broadcast bucket "
                                              f"within {wait:.0f}s")
            elif c.error:
                fails[name] = c.error[0]
        return fails

    def _drain(self, keep: int = 0) -> dict[str, BaseException]:
        """Wait for the announces of every broadcast but the last `keep`; their failures."""
        fails: dict[str, BaseException] = {}
        cut = max(0, len(self.pending) - keep)
        done, self.pending = self.pending[:cut], self.pending[cut:]
        for calls, _ in done:
            for name, err in self._collect(calls, self.options.timeout).items():
                fails.setdefault(name, err)
        return fails

    def _alive(self, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        """Engines that no longer answer health (a dead rank broke the broadcast)."""
        dead: dict[str, BaseException] = {}
        for a in engines:
            try:
                a.health()
            except Exception as e:  # noqa: BLE001 - this engine is gone
                dead[a.engine_name] = e
        return dead

    def discard(self, payload: Payload) -> None:
        with self._ahead_lock:
            ahead = self._ahead.pop(payload.index, None)
            if ahead is not None:
                self._drop_ahead(ahead)
        self._release(payload.body)

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        try:
            return self._send(payload, engines)
        finally:
            self._release(payload.body)

    def _send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        failures: dict[str, BaseException] = {}
        layout = self._layout(engines)
        engines = list(engines)
        # weightsync's receivers take the whole body and read its own header: nothing to parse
        # or to repeat in the announce (the payload header lists the tensors already)
        pieces = ([(payload.body, "uint8", None)] if layout == "safetensors"
                  else split_payload(payload.body, layout))
        k = 0
        attempts = 0
        ahead = self._take_ahead(payload, engines)
        while k < len(pieces) and engines:
            fails = self._ensure(engines)
            failures.update(fails)
            engines = [a for a in engines if a.engine_name not in fails]
            if not engines or self.group is None:
                break
            tensor, dtype, specs = pieces[k]
            # an engine that serves announces in arrival order must see k done before k+1; the
            # others stage the previous bucket while this one is broadcast, and never hold more
            # than two: the one before that must be staged first. Waiting here, not right after
            # the previous broadcast, lets the exporter pack the next bucket meanwhile.
            keep = 1 if all(a.ordered_announces for a in engines) else 0
            for name, err in self._drain(keep).items():
                failures.setdefault(name, err)
            if ahead is not None and ahead.group == self.group.name:
                calls, wake = ahead.calls, ahead.wake
            else:
                with self._ahead_lock:       # announced here: later payloads are too
                    self._ahead_next = -1
                fields = {"group_name": self.group.name, "layout": layout, "seq": self._seq,
                          "nbytes": tensor.numel() * tensor.element_size(), "dtype": dtype,
                          "numel": tensor.numel()}
                if specs is not None:
                    fields["tensors"] = specs
                header = payload.header(**fields)
                wake = threading.Event()
                calls = {a.engine_name: _spawn(a.announce, header, wake=wake) for a in engines}
            try:
                self._broadcast(self._device(tensor), calls, payload.body, wake)
            except Exception as e:  # noqa: BLE001 - find who broke it, rebuild, send again
                attempts += 1
                ahead = None
                with self._ahead_lock:
                    self._ahead_next = -1
                failures.update(self._broken(engines, calls, attempts, payload.index, e))
                engines = [a for a in engines if a.engine_name not in failures]
                self.key = None              # the group has a broken rank: rebuild it
                for name, err in self._drain().items():
                    failures.setdefault(name, err)
                continue
            self._seq += 1
            self.pending.append((calls, payload.index))
            ahead = None
            k += 1
        return failures

    def _broadcast(self, tensor: torch.Tensor, calls: dict[str, _Call], body: torch.Tensor,
                   wake: threading.Event | None = None) -> None:
        """Broadcast while watching the announces: an engine that failed before it posted its
        receive would leave rank 0 waiting for the whole timeout, so the broadcast is abandoned
        as soon as one announce fails (the group is rebuilt; the buffer is retired, since the
        abandoned operation may still read it). The wait wakes on the broadcast's completion or
        an announce's failure, whichever comes first (no polling delay per bucket)."""
        work = pgs.start_broadcast(self.group.pg, tensor, self.options.timeout)
        wake = wake or threading.Event()
        try:
            work.get_future().add_done_callback(lambda _: wake.set())
        except (AttributeError, RuntimeError):       # a backend without futures: poll
            wake = None
        deadline = time.monotonic() + self.options.timeout
        nap = 0.0005
        while not work.is_completed():
            bad = [(n, c.error[0]) for n, c in calls.items() if c.error]
            if bad or time.monotonic() > deadline:
                self._retire(body)
                if bad:
                    raise TransportError(f"engine {bad[0][0]} failed before receiving the "
                                         f"broadcast: {bad[0][1]}")
                raise TransportError(f"broadcast did not complete within {self.options.timeout}s")
            if wake is not None and not wake.is_set():
                wake.wait(min(0.25, max(0.0, deadline - time.monotonic())))
            else:       # no future, or it fired a moment before the work says completed
                time.sleep(nap)
                nap = min(nap * 2, 0.005)
        pgs.finish_broadcast(work, tensor, self.options.timeout)

    def _retire(self, body: torch.Tensor) -> None:
        for b in self._ring:
            if b.holds(body):
                b.tensor = None          # the next alloc of this slot gets fresh memory
                b.free.set()

    def _broken(self, engines: Sequence[Adapter], calls: dict[str, _Call], attempts: int,
                index: int, err: BaseException) -> dict[str, BaseException]:
        """Who broke a broadcast. First the engines that no longer answer health (the survivors
        wait in a broadcast that never completes, so they are resent to through a new group);
        on a second failure also the engines whose announce itself failed; on a third, all."""
        fails: dict[str, BaseException] = {}
        dead = self._alive(engines)
        for a in engines:
            c = calls[a.engine_name]
            if a.engine_name in dead:
                fails[a.engine_name] = c.error[0] if c.done(0.5) and c.error else dead[a.engine_name]
            elif attempts >= 2 and c.done(0.5) and c.error:
                fails[a.engine_name] = c.error[0]
        if attempts >= 3 or (attempts >= 2 and not fails):
            for a in engines:
                fails.setdefault(a.engine_name, TransportError(
                    f"broadcast of bucket {index} failed twice: {err}"))
        return fails

    def finish(self, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        self._forget_ahead()
        return self._drain()

    def close(self) -> None:
        self._forget_ahead()
        self._drain()
        self._destroy()
