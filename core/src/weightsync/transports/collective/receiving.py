"""The engine's half of transport `collective`: join the trainer's group (one per process, kept
across rounds) and receive one broadcast per announce, in the sender's order."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import BaseModel

from weightsync.errors import PayloadError, TransportError
from weightsync.interfaces import Stages, TransportReceiver
from weightsync.transports.collective import pg as pgs
from weightsync.transports.collective.messages import Broadcast, JoinGroup, LeaveGroup
_GROUPS: dict[str, tuple[pgs.Group, "_Order"]] = {}
_GROUPS_LOCK = threading.Lock()


class _Order:
    """Broadcasts are received in the sender's `seq` order, whatever order announces come in."""

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
        old = list(_GROUPS.values())
        _GROUPS.clear()
    for _, o in old:
        o.end()
    for g, _ in old:
        pgs.forget(g.pg)
        # a group whose peer died may block in shutdown: never on the caller's thread
        threading.Thread(target=pgs.shutdown, args=(g.pg,), daemon=True, name="ws-pg-destroy").start()


class _RecvPool:
    """Receive buffers reused across buckets and rounds (warm memory, no page faults)."""

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
    """Joins the trainer's group (kept across rounds); receives one broadcast per announce."""

    private = True      # a broadcast lands in this process's own receive buffers

    def __init__(self, options: BaseModel) -> None:
        super().__init__(options)
        self._lent: dict[tuple[Any, int], torch.Tensor] = {}

    def deliver(self, kind: str, body: Mapping[str, Any], session: Stages) -> dict[str, Any]:
        """Join (blocking until every rank is in), leave, or receive one broadcast."""
        if kind == JoinGroup.kind:
            self.join(body)
            return {}
        if kind == LeaveGroup.kind:
            _forget_groups()
            return {}
        if kind == Broadcast.kind:
            return {"digest": session.apply(body, None)}
        return super().deliver(kind, body, session)

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
        tr: Mapping[str, Any] = header.get("transport") or {}
        name = tr.get("group_name")
        layout = tr.get("layout", "safetensors")
        if layout != "safetensors":
            raise PayloadError(f"weightsync's receiver takes layout 'safetensors', not {layout!r}")
        with _GROUPS_LOCK:
            entry = _GROUPS.get(name) if name is not None else None
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
