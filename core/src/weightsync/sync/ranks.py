"""The one place of the push that knows the trainer's ranks: whether the push runs in a
torch.distributed job, and which rank this process is. Every part of the push that behaves
differently on rank 0 (the pipeline, the round, the probe) asks here."""

from __future__ import annotations

import json
from typing import Any

from weightsync.sync.report import SyncReport

__all__ = ["device_of", "gather_json", "is_follower", "rank", "share_int", "share_json",
           "share_report", "world"]


def world() -> Any:
    """`torch.distributed` when this process is in an initialized group, else None."""
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    """This process's rank in the trainer's group; 0 when it is not distributed."""
    dist = world()
    return dist.get_rank() if dist is not None else 0


def device_of(dist: Any) -> Any:
    """Where the group's collectives run: the current CUDA device under nccl, else the CPU."""
    import torch
    gpu = dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if gpu else "cpu"


def _done(work: Any, timeout: float | None) -> None:
    """Wait for a collective; past `timeout` seconds a RuntimeError (a rank frozen or gone)."""
    import datetime
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=max(0.1, timeout)))


def share_int(value: int | None, timeout: float | None = None) -> int:
    """Rank 0's `value` on every rank of the trainer's default group (the others pass None)."""
    import torch
    dist = world()
    assert dist is not None
    t = torch.tensor([value if value is not None else 0], dtype=torch.int64, device=device_of(dist))
    _done(dist.broadcast(t, 0, async_op=True), timeout)
    return int(t.item())


def share_json(value: Any = None, *, leader: bool, timeout: float | None = None) -> Any:
    """Rank 0's JSON `value` on every rank (JSON bytes in a tensor broadcast: never pickle);
    `timeout`: seconds each of its two broadcasts may wait for the other ranks."""
    import torch
    dist = world()
    assert dist is not None
    data = json.dumps(value).encode() if leader else b""
    n = share_int(len(data) if leader else None, timeout)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if leader and n
           else torch.empty(n, dtype=torch.uint8)).to(device_of(dist))
    _done(dist.broadcast(buf, 0, async_op=True), timeout)
    return value if leader else json.loads(bytes(buf.cpu().numpy()))


def gather_json(value: Any, timeout: float | None = None) -> list[Any]:
    """Every rank's JSON `value`, in rank order, on every rank (one all-gather of the sizes,
    one of the padded bytes, each waiting at most `timeout` seconds)."""
    import torch
    dist = world()
    assert dist is not None
    dev = device_of(dist)
    data = json.dumps(value).encode()
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    _done(dist.all_gather(sizes, n, async_op=True), timeout)
    most = max(int(s.item()) for s in sizes)
    buf = torch.zeros(most, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    bufs = [torch.empty(most, dtype=torch.uint8, device=dev) for _ in sizes]
    _done(dist.all_gather(bufs, buf.to(dev), async_op=True), timeout)
    return [json.loads(bytes(b[:int(s.item())].cpu().numpy())) for b, s in zip(bufs, sizes)]


def is_follower() -> bool:
    """A rank other than 0 of a multi-rank trainer: it joins rank 0's push (the exporter's
    gathers are collectives every rank must run) and gets rank 0's report."""
    return rank() != 0


def share_report(report: SyncReport | None) -> SyncReport:
    """Rank 0's report on every rank; every rank calls this once per push, rank 0 with its own."""
    got = share_json(report.to_json() if report is not None else None, leader=report is not None)
    if report is not None:
        return report
    out = SyncReport.from_json(got)
    out.rank = rank()
    return out
