"""What every bench row measures: wall time, CPU time and the sender's peak extra memory
(`PeakRss`, `timed`), the `Row` they make, and the small helpers rows share."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DELTA_DENSITY = 0.01
MOE = "moe/"                # the MoE model's names in the bench workers (they hold every model)
BARE_VERIFIED = "gloo broadcast, 1 receiver, verified (bare)"


# -- memory -----------------------------------------------------------------------------------
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class PeakRss:
    """Peak resident memory of this process above its level at start, in bytes. Memory that the
    allocator serves from blocks it freed earlier but kept resident does not show: call
    `exact_malloc` first, as the bench does."""

    def __init__(self) -> None:
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.method = "VmHWM"

    def __enter__(self) -> PeakRss:  # noqa: PYI034 - final class, used as a context manager
        gc.collect()
        self.base = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.method = "sampling"
            self.peak = self.base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _status_kib("VmRSS"))

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak = _status_kib("VmHWM")

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base) * 1024


def exact_malloc() -> bool:
    """Make glibc return every large free block to the kernel (fixed mmap threshold, 1 MiB), so
    peak RSS measures the memory a row really held, not what the allocator kept cached after
    another thread freed it."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 20))
    except (OSError, AttributeError):
        return False


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system, every thread) of this process and of `pids` so far."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return -1.0


# -- rows -------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    kind: str                        # floor | baseline | transport
    bytes: int
    receivers: int
    seconds: float
    runs: list[float]
    peak_extra_bytes: int
    detail: dict[str, Any] = field(default_factory=dict)
    floor: str | None = None         # the row this one is compared with (its own floor)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


PIDS: list[int] = []          # the receivers' processes of the rows running now (CPU accounting)


def timed(name: str, kind: str, nbytes: int, receivers: int, fn: Callable[[], Any], repeat: int,
          setup: Callable[[], Any] | None = None, log: Callable[[str], None] = print,
          prepare: Callable[[], Any] | None = None, floor: str | None = None) -> Row:
    """Setup and one warm-up run, then `repeat` timed runs, all inside one peak-memory window.
    `prepare` runs untimed before every run; a run that returns {"seconds": s} timed itself
    (it had an untimed part in the middle). Each run's CPU time (this process and `PIDS`, in
    core-seconds) is kept next to its wall time: on a shared machine it moves less than the
    wall time does, and it says how much of the cores a row needs."""
    runs: list[float] = []
    cpus: list[float] = []
    details: list[Any] = []
    with PeakRss() as mem:
        if setup is not None:
            setup()
        if prepare is not None:
            prepare()
        fn()
        for _ in range(repeat):
            if prepare is not None:
                prepare()
            c0 = cpu_seconds(PIDS)
            t0 = time.perf_counter()
            d = fn()
            dt = time.perf_counter() - t0
            cpus.append(cpu_seconds(PIDS) - c0)
            if isinstance(d, dict) and "seconds" in d:
                dt = float(d.pop("seconds"))
            runs.append(dt)
            details.append(d)
    best = min(range(len(runs)), key=runs.__getitem__)
    detail = details[best] if isinstance(details[best], dict) else {}
    detail = {**detail, "cpu_s": round(cpus[best], 4), "cpu_runs": [round(c, 4) for c in cpus],
              "loadavg": round(loadavg(), 2)}
    row = Row(name, kind, nbytes, receivers, runs[best], runs, mem.extra, detail, floor)
    pause = detail.get("pause_window")
    log(f"  {name:<44} {row.seconds:8.3f} s  {row.gbps:6.2f} GB/s  cpu {cpus[best]:6.2f} s  peak extra "
        f"{row.peak_extra_bytes / 2**20:8.1f} MiB" + (f"  pause {pause:.3f} s" if pause is not None else "")
        + f"  (load {loadavg():.1f})")
    return row


def perturbed(sd: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of `sd` in which about `density` of every tensor's elements moved by 1-4 ulps (the
    size of an optimizer step on bf16 weights)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in sd.items():
        new = t.clone()
        b = new.view(torch.int16 if t.element_size() == 2 else torch.int32).reshape(-1)
        k = max(1, int(round(density * b.numel())))
        pos = torch.randint(0, b.numel(), (k,), generator=g)
        step = torch.randint(1, 5, (k,), generator=g, dtype=b.dtype)
        b[pos] += step
        out[n] = new
    return out



def push_detail(r: Any) -> dict[str, Any]:
    return {"stages": {k: round(v, 4) for k, v in r.seconds.items()}, "buckets": r.buckets,
            "wire_bytes": r.wire_bytes, "pause_window": round(r.pause_window, 4)}


def drop_cache(path: Path) -> None:
    """Evict a file's or a tree's clean pages, so the next read comes from the disk."""
    for p in ([path] if path.is_file() else sorted(path.rglob("*"))):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

