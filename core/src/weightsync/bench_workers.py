"""Receiver processes for the bench's naive baselines: each holds preallocated weights (as an
engine would) and, on command from the trainer, loads a safetensors checkpoint into them or
receives torch.distributed gloo broadcasts (one per tensor, or one single tensor).

The commands travel over a multiprocessing Pipe between the bench and its own child processes
(same host, same user): plain tuples of strings, ints and lists."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import torch

from .bucket import dtype_from_name


def _worker(conn: Any, rank: int) -> None:
    from safetensors.torch import load_file

    from .transports import pg as pgs
    torch.set_num_threads(1)
    groups: dict[str, Any] = {}
    weights: dict[str, torch.Tensor] = {}
    flat: dict[int, torch.Tensor] = {}
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "quit":
                conn.send(("ok", None))
                return
            if cmd == "join":          # arg: (key, address, port, group rank, world, timeout)
                key, addr, port, grank, world, timeout = arg
                store = pgs.make_store(addr, port, world, False, timeout)
                groups[key] = pgs.new_group(store, f"bench-{key}", grank, world, "gloo", timeout)
                out = None
            elif cmd == "alloc":       # arg: [(name, dtype, shape)]
                weights = {n: torch.zeros(s, dtype=dtype_from_name(d)) for n, d, s in arg}
                out = None
            elif cmd == "per_tensor":  # arg: (group key, names in send order)
                key, names = arg
                for n in names:
                    pgs.broadcast(groups[key], weights[n], 600)
                out = None
            elif cmd == "single":      # arg: (group key, nbytes)
                key, nbytes = arg
                buf = flat.get(nbytes)
                if buf is None:
                    buf = flat[nbytes] = torch.zeros(nbytes, dtype=torch.uint8)
                pgs.broadcast(groups[key], buf, 600)
                out = None
            elif cmd == "load":        # arg: checkpoint path; copy into the live weights
                t0 = time.perf_counter()
                for n, t in load_file(arg).items():
                    weights[n].copy_(t)
                out = time.perf_counter() - t0
            elif cmd == "checksum":    # arg: names; a cheap proof the bytes arrived
                out = [float(weights[n].float().sum()) for n in arg]
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 - handed to the bench, which raises it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class Workers:
    """R receiver processes started before any timing."""

    def __init__(self, count: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns = []
        self.procs = []
        for r in range(count):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, r + 1), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def post(self, cmds: list[tuple[str, Any]] | tuple[str, Any], only: int | None = None) -> list[int]:
        idx = list(range(len(self.conns))) if only is None else list(range(only))
        for i in idx:
            self.conns[i].send(cmds[i] if isinstance(cmds, list) else cmds)
        return idx

    def wait(self, idx: list[int], timeout: float = 600) -> list[Any]:
        out = []
        for i in idx:
            if not self.conns[i].poll(timeout):
                raise TimeoutError(f"bench worker {i + 1} did not answer within {timeout}s")
            status, value = self.conns[i].recv()
            if status != "ok":
                raise RuntimeError(f"bench worker {i + 1}: {value}")
            out.append(value)
        return out

    def call(self, cmd: tuple[str, Any], only: int | None = None, timeout: float = 600) -> list[Any]:
        return self.wait(self.post(cmd, only), timeout)

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            try:
                c.send(("quit", None))
                p.join(10)
            except (OSError, EOFError):
                pass
            if p.is_alive():
                p.kill()
