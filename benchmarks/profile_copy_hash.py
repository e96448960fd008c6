"""Where a verified CPU sync's time goes on this machine, per GiB and per core: one copy, one
xxh3-128 pass over memory, the two in sequence (what every stage did before issue 17), the
one-pass copy + digest (`weightsync.wire.digests.copy_digest`) on each of its paths, and the sender's
encode and a receiver's stage built on it. Also the CPU time (core-seconds) every number costs,
which moves less than wall time on a shared machine.

Run: .venv/bin/python benchmarks/profile_copy_hash.py"""

from __future__ import annotations

import ctypes
import os
import time

import torch
import xxhash

from weightsync.wire import digests as hashing
from weightsync.wire.bucket import Bucket
from weightsync.encodings.raw import RawEncoding
from weightsync.receive import stage_digest
from weightsync.wire.frame import unpack

N = 2**30


def best(f, k: int = 5) -> tuple[float, float]:
    """(best wall seconds, CPU seconds of that run) over k runs."""
    out = (9e9, 0.0)
    for _ in range(k):
        c0, t0 = time.process_time(), time.perf_counter()
        f()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        out = min(out, (dt, dc))
    return out


def main() -> None:
    print(f"load average {os.getloadavg()[0]:.1f}; copy + digest path here: {hashing.path()}")
    src = torch.empty(N, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    hashing.warm()
    rows = []
    torch.set_num_threads(2)
    rows.append(("memcpy, torch, 2 threads", best(lambda: dst.copy_(src))))
    torch.set_num_threads(1)
    rows.append(("memcpy, glibc, 1 thread", best(lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), N))))
    rows.append(("xxh3-128 pass over memory", best(lambda: xxhash.xxh3_128(src.numpy()).hexdigest())))

    def two_pass() -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), N)
        xxhash.xxh3_128(dst.numpy()).hexdigest()
    rows.append(("copy, then hash (two passes)", best(two_pass)))
    for path in ("numba", "ctypes"):
        hashing.JIT = path == "numba"
        if path == "numba" and hashing.jit() is None:
            continue
        rows.append((f"copy + digest, one pass ({path})",
                     best(lambda: hashing.copy_digest(dst, src, b"h"))))
        rows.append((f"digest + streamed copy, one pass ({path})",
                     best(lambda: hashing.copy_digest(dst, src, b"h", source=True))))
    hashing.JIT = True
    torch.set_num_threads(2)
    model = [(f"w{i}", src[i * 2**26:(i + 1) * 2**26].view(torch.bfloat16)) for i in range(16)]
    enc = RawEncoding()
    buf = torch.empty(2**26 + 4096, dtype=torch.uint8)
    rows.append(("sender encode: pack + digest (16 x 64 MiB)",
                 best(lambda: [enc.encode(Bucket(i, [model[i]]), alloc=lambda k: buf[:k]) for i in range(16)])))
    named = unpack(enc.encode(Bucket(0, [model[0]])).body)[0]
    stg = torch.empty(2**25, dtype=torch.bfloat16)
    rows.append(("receiver stage: copy + digest (16 x 64 MiB)",
                 best(lambda: [stage_digest(named, lambda n, t: stg, "xxh3") for _ in range(16)])))
    rows.append(("receiver stage from its own buffer (16 x 64 MiB)",
                 best(lambda: [stage_digest(named, lambda n, t: stg, "xxh3", True) for _ in range(16)])))
    for name, (s, c) in rows:
        print(f"{name:<50} {s:7.3f} s/GiB  ({1 / s:5.1f} GiB/s)  cpu {c:6.3f} s")


if __name__ == "__main__":
    main()
