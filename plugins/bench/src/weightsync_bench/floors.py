"""The floors and naive baselines of `weightsync bench` that need no engine: one memcpy of the
model, the one-core copy and hashing references, raw loopback TCP to every receiver, raw gloo
broadcasts (and a bare verified one), a full safetensors save + load, and a gloo broadcast per
tensor."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weightsync_bench.measure import BARE_VERIFIED, MOE, Row, timed
from weightsync_bench.model import model_bytes


def _memcpy_floor(sd: dict[str, torch.Tensor]) -> tuple[Callable[[], None], Callable[[], dict[str, Any]]]:
    """One copy of the model into preallocated memory: the faster of torch's copy on all cores
    and glibc's memcpy on one (on a loaded machine a parallel copy waits for its slowest core)."""
    import ctypes
    dst: dict[str, torch.Tensor] = {}

    def setup() -> None:
        dst.update({n: torch.empty_like(t) for n, t in sd.items()})

    def run() -> dict[str, Any]:
        t0 = time.perf_counter()
        for n, t in sd.items():
            dst[n].copy_(t)
        t1 = time.perf_counter()
        for n, t in sd.items():
            ctypes.memmove(dst[n].data_ptr(), t.data_ptr(), t.numel() * t.element_size())
        t2 = time.perf_counter()
        return {"seconds": min(t1 - t0, t2 - t1), "torch_all_cores_s": round(t1 - t0, 4),
                "memcpy_one_core_s": round(t2 - t1, 4)}
    return setup, run


def _one_core_rows(sd: dict[str, torch.Tensor], repeat: int, log: Callable[[str], None]) -> list[Row]:
    """What verifying costs per byte on one core: a plain copy (memmove), the same copy hashing
    each piece as it is read (`hashing.copy_digest`, streamed stores, as every stage of a sync
    runs it), and a hashing pass over memory."""
    import ctypes

    import xxhash

    from weightsync.wire.bucket import tensor_header
    from weightsync.wire.digests import copy_digest
    n = model_bytes(sd)
    dst = {k: torch.empty_like(t) for k, t in sd.items()}

    def move() -> None:
        for k, t in sd.items():
            ctypes.memmove(dst[k].data_ptr(), t.data_ptr(), t.numel() * t.element_size())

    def fused() -> None:
        for k, t in sd.items():
            copy_digest(dst[k], t, tensor_header(k, t), source=True)

    def hashed() -> None:
        for t in sd.values():
            # numpy's stubs give ndarray __buffer__ only on Python 3.12+
            xxhash.xxh3_128(
                t.reshape(-1).view(torch.uint8).numpy()).hexdigest()  # type: ignore[arg-type]
    return [timed("memcpy (1 core)", "reference", n, 1, move, max(3, repeat), None, log),
            timed("xxh3 + copy, one pass (1 core)", "reference", n, 1, fused, max(3, repeat), None, log),
            timed("xxh3 pass over memory (1 core)", "reference", n, 1, hashed, max(3, repeat), None, log)]


# -- floors and baselines that need no engine -------------------------------------------------
class TcpFloor:
    """One raw loopback TCP stream of the model's bytes to each receiver at once (plain sockets,
    no framing): each bench worker reads them into warm memory and answers over its pipe."""

    def __init__(self, workers: Any, count: int, flat: torch.Tensor) -> None:
        self.workers, self.count, self.flat = workers, count, flat
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(count)
        port = self.listener.getsockname()[1]
        idx = workers.post(("tcp_connect", ("127.0.0.1", port, flat.numel())), only=count)
        self.conns = []
        for _ in range(count):
            c, _ = self.listener.accept()
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns.append(c)
        workers.wait(idx)

    def run(self) -> None:
        idx = self.workers.post(("tcp_recv", self.flat.numel()), only=self.count)
        # numpy's stubs give ndarray __buffer__ only on Python 3.12+
        view = memoryview(self.flat.numpy())  # type: ignore[arg-type]
        threads = [threading.Thread(target=c.sendall, args=(view,)) for c in self.conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.workers.wait(idx)

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.listener.close()


def flatten(sd: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's bytes as one uint8 tensor (untimed preparation of the raw floors)."""
    n = model_bytes(sd)
    flat = torch.empty(n, dtype=torch.uint8)
    off = 0
    for t in sd.values():
        k = t.numel() * t.element_size()
        flat[off: off + k].copy_(t.reshape(-1).view(torch.uint8))
        off += k
    return flat



class Baselines:
    """The engine-free rows, as a part of `Bench` (which holds the attributes named here)."""

    receivers: int
    repeat: int
    bucket: int
    work: Path
    rows: list[Row]
    log: Callable[[str], None]

    def _baselines(self, sd: dict[str, torch.Tensor], small: dict[str, torch.Tensor],
                   moe: dict[str, torch.Tensor] | None, workers: Any) -> None:
        from safetensors.torch import save_file

        from weightsync.net.server import free_port
        from weightsync.transports.collective import pg as pgs
        R, n = self.receivers, model_bytes(sd)
        raw_r, raw_1 = "gloo broadcast, 1 tensor (raw)", "gloo broadcast, 1 tensor (raw, 1 receiver)"
        flat = flatten(sd)

        tcp = TcpFloor(workers, R, flat)
        try:
            self.rows.append(timed("http floor (raw TCP)", "floor", n, R, tcp.run, max(3, self.repeat),
                                   None, self.log, floor="http floor (raw TCP)"))
        finally:
            tcp.close()

        ckpt = self.work / "ckpt" / "model.safetensors"
        ckpt.parent.mkdir(parents=True, exist_ok=True)

        def save_load() -> dict[str, Any]:
            t0 = time.perf_counter()
            save_file(sd, str(ckpt))
            t_save = time.perf_counter() - t0
            loads = workers.call(("load", str(ckpt)))
            return {"save_s": t_save, "load_s": max(loads)}
        self.rows.append(timed("safetensors save+load (naive)", "baseline", n, R, save_load,
                               self.repeat, None, self.log, floor="memcpy floor"))
        ckpt.unlink(missing_ok=True)

        # gloo groups: all receivers, and rank 0 + the first receiver alone
        groups: dict[str, Any] = {}

        def join(key: str, count: int) -> None:
            store = pgs.make_store("127.0.0.1", free_port(), count + 1, True, 120)
            idx = workers.post([("join", (key, "127.0.0.1", store.port, i + 1, count + 1, 120))
                                for i in range(R)], only=count)
            groups[key] = pgs.new_group(store, f"bench-{key}", 0, count + 1, "gloo", 120)
            workers.wait(idx)
        join("all", R)
        join("one", 1)
        try:
            def single(key: str, count: int) -> Callable[[], None]:
                def go() -> None:
                    idx = workers.post(("single", (key, n)), only=count)
                    pgs.broadcast(groups[key], flat, 600)  # noqa: F821 (del later)
                    workers.wait(idx)
                return go
            self.rows.append(timed(raw_r, "floor", n, R, single("all", R), max(3, self.repeat),
                                   None, self.log, floor=raw_r))
            self.rows.append(timed(raw_1, "floor", n, 1, single("one", 1), max(3, self.repeat),
                                   None, self.log, floor=raw_1))

            def verified() -> None:
                # the sender hashes each chunk while it is broadcast (both only read it), the
                # receiver hashes each chunk in place while the next one arrives
                from concurrent.futures import ThreadPoolExecutor

                from weightsync.wire.bucket import tensor_digest
                idx = workers.post(("verified", ("one", n, self.bucket)), only=1)
                pending = []
                with ThreadPoolExecutor(1) as hasher:
                    for i, at in enumerate(range(0, n, self.bucket)):
                        piece = flat[at: at + self.bucket]  # noqa: F821 (del later)
                        pending.append(hasher.submit(tensor_digest, f"c{i}", piece))
                        pgs.broadcast(groups["one"], piece, 600)
                    mine = [f.result() for f in pending]
                if workers.wait(idx)[0] != mine:
                    raise RuntimeError("bare verified broadcast: the digests differ")
            self.rows.append(timed(BARE_VERIFIED, "floor", n, 1, verified, max(3, self.repeat),
                                   None, self.log, floor=raw_1))
            del flat

            def per_tensor(model: dict[str, torch.Tensor], prefix: str = "") -> Callable[[], None]:
                def go() -> None:
                    names = list(model)
                    idx = workers.post(("per_tensor", ("all", [prefix + k for k in names])))
                    for k in names:
                        pgs.broadcast(groups["all"], model[k], 600)
                    workers.wait(idx)
                return go
            self.rows.append(timed("gloo broadcast per tensor (naive)", "baseline", n, R,
                                   per_tensor(sd), self.repeat, None, self.log, floor=raw_r))
            self.rows.append(timed("gloo broadcast per tensor (small tensors)", "baseline",
                                   model_bytes(small), R, per_tensor(small), self.repeat, None,
                                   self.log, floor=raw_r))
            if moe:
                self.rows.append(timed("gloo broadcast per tensor (MoE)", "baseline",
                                       model_bytes(moe), R, per_tensor(moe, MOE), self.repeat, None,
                                       self.log, floor=raw_r))
        finally:
            for g in groups.values():
                pgs.forget(g)

