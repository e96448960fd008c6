"""Receiver processes for the bench's naive baselines and floors: each holds preallocated weights
(as an engine would) and, on command from the trainer, loads a safetensors checkpoint into them,
receives torch.distributed gloo broadcasts (one per tensor, one single tensor, or bucket-sized
chunks hashed as they land: the bare verified floor) or reads a raw TCP stream of the model's
bytes into warm memory.

The commands travel over a multiprocessing Pipe between the bench and its own child processes
(same host, same user): plain tuples of strings, ints and lists.

Also here: the bench's "verify off" instrument (`unhashed`), which replaces the one-pass copy +
digest by a plain copy in the bench process and, through a `sitecustomize` on PYTHONPATH, in the
engine processes started for those rows only. A process under it reports a fixed digest for every
tensor, so it can never pass verification against a normal peer: a bench tool, nothing else."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from weightsync.wire.bucket import dtype_from_name


def _worker(conn: Any, rank: int) -> None:
    from safetensors.torch import load_file

    from weightsync.transports.collective import pg as pgs
    torch.set_num_threads(1)
    groups: dict[str, Any] = {}
    weights: dict[str, torch.Tensor] = {}
    flat: dict[int, torch.Tensor] = {}
    sock: socket.socket | None = None
    while True:
        cmd, arg = conn.recv()
        out: Any                        # the command's answer
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
            elif cmd == "verified":    # arg: (group key, nbytes, chunk): the bare verified floor
                key, nbytes, chunk = arg
                out = _receive_verified(groups[key], nbytes, chunk, flat)
            elif cmd == "tcp_connect":  # arg: (address, port, nbytes): the raw TCP floor
                addr, port, nbytes = arg
                sock = socket.create_connection((addr, port))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if nbytes not in flat:
                    flat[nbytes] = torch.zeros(nbytes, dtype=torch.uint8)
                out = None
            elif cmd == "tcp_recv":    # arg: nbytes, read into warm memory
                assert sock is not None
                # numpy's stubs give ndarray __buffer__ only on Python 3.12+
                view = memoryview(flat[arg].numpy())  # type: ignore[arg-type]
                got = 0
                while got < arg:
                    k = sock.recv_into(view[got:], min(arg - got, 1 << 24))
                    if not k:
                        raise ConnectionError(f"stream ended after {got} of {arg} bytes")
                    got += k
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


def _receive_verified(pg: Any, nbytes: int, chunk: int, cache: dict[int, Any]) -> list[str]:
    """The least work a verified receive can do: `nbytes` as broadcasts of `chunk` bytes into
    three warm buffers used in turn, each hashed in place on a second thread while the next one
    arrives (no staging copy, no framework); the digests, for the bench to compare."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.wire.bucket import tensor_digest
    from weightsync.transports.collective import pg as pgs
    bufs = cache.get(-chunk)
    if bufs is None:
        bufs = cache[-chunk] = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(3)]
    pending: list[Any] = []
    digests: list[str] = []
    with ThreadPoolExecutor(1) as hasher:
        for i, at in enumerate(range(0, nbytes, chunk)):
            if len(pending) == 2:
                digests.append(pending.pop(0).result())
            buf = bufs[i % 3][: min(chunk, nbytes - at)]
            pgs.broadcast(pg, buf, 600)
            pending.append(hasher.submit(tensor_digest, f"c{i}", buf))
        digests += [f.result() for f in pending]
    return digests


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


# -- the "verify off" instrument ----------------------------------------------------------------
UNHASHED = "0" * 32


def _copy_only(dst: torch.Tensor, src: torch.Tensor, header: bytes, source: bool = False) -> str:
    """`hashing.copy_digest` without the digest: the same one-pass copy (memmove, no GIL)."""
    if dst.numel() != src.numel():
        raise ValueError(f"copy of {src.numel()} elements into a tensor of {dst.numel()}")
    n = dst.numel() * dst.element_size()
    if n and dst.dtype == src.dtype and dst.device.type == src.device.type == "cpu" \
            and dst.is_contiguous() and src.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    elif n:
        dst.copy_(src)
    return UNHASHED


class _NoDigest:
    """`hashing.Digest` that hashes nothing (the streamed receive of `receive.read_staged`)."""

    address = None

    def __init__(self, header: bytes, native: bool = True) -> None:
        pass

    def update(self, data: Any) -> None:
        pass

    def update_at(self, address: int, nbytes: int) -> None:
        pass

    def hexdigest(self) -> str:
        return UNHASHED


def unhash() -> None:
    """From now on this process copies without hashing and reports a fixed digest."""
    from weightsync.wire import digests as hashing
    hashing.copy_digest = _copy_only
    setattr(hashing, "Digest", _NoDigest)       # a class swapped for a stand-in


@contextlib.contextmanager
def unhashed(on: bool = True) -> Iterator[None]:
    """The bench process without digests, for the duration (the sender side of a verify-off row)."""
    from weightsync.wire import digests as hashing
    real = hashing.copy_digest, hashing.Digest
    if on:
        unhash()
    try:
        yield
    finally:
        hashing.copy_digest = real[0]
        setattr(hashing, "Digest", real[1])


def unhashed_env(work: Path) -> dict[str, str]:
    """Environment for engine processes that run without digests (the receiving side of a
    verify-off row): a `sitecustomize` on PYTHONPATH applies `unhash()` at start."""
    d = Path(work) / "unhashed-site"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(
        "# weightsync bench: engines of the verify-off rows copy without hashing\n"
        "from weightsync_bench.workers import unhash\n"
        "unhash()\n")
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(d) + (os.pathsep + path if path else "")}
