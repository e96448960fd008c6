"""The GPU rows of `weightsync bench` (run when CUDA is available, or with `--device cuda`):

- cuda copy floor: one device-to-device copy of the model's bytes (`copy_` into preallocated
  device memory): what any same-GPU path must at least do;
- cuda ipc copy (raw): a receiver process opens one CUDA IPC handle of the model's bytes (as a
  single flat buffer) and copies them into its own device memory, timed from the sender's side
  (the signal and the answer included): the carry of the `shm` transport on a GPU, unverified;
- per-tensor CUDA IPC (naive): what colocated RL trainers do today (SGLang's tensor route, verl's
  IPC path): one IPC handle per tensor, pickled through a pipe between the bench's own processes,
  the receiver rebuilds it and copies the tensor into its weights;
- shm (CUDA IPC, verified): `WeightSync.push` of the CUDA state dict into `--receivers`
  reference engines holding their weights on the GPU (`weightsync serve --device cuda`):
  health, pause, pack into the IPC buffers, announce, stage, mlh digests on both sides on the
  device, verify, commit, resume; and the same with `verify: false`.

Sender peak extra memory for these rows is GPU memory (`torch.cuda.max_memory_allocated` above
the level before the row)."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any, Callable

import torch

from weightsync_bench.model import model_bytes


def _bench_cuda(fn: Callable[[], Any], repeat: int) -> tuple[float, list[float]]:
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    return min(runs), runs


def _receiver(conn: Any) -> None:
    """Bench child: copies out of CUDA IPC handles on command (the bench's own pipe, its own
    processes: the handles are torch's reductions)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    torch.cuda.set_device(0)
    flat: torch.Tensor | None = None
    dst: torch.Tensor | None = None
    weights: dict[str, torch.Tensor] = {}
    while True:
        cmd, arg = conn.recv()
        if cmd == "quit":
            return
        if cmd == "flat":                       # arg: rebuild args of the flat buffer
            flat = rebuild_cuda_tensor(*arg)
            dst = torch.empty_like(flat)
        elif cmd == "copy":
            assert flat is not None and dst is not None     # "flat" comes first
            dst.copy_(flat)
            torch.cuda.synchronize()
        elif cmd == "alloc":                    # arg: [(name, dtype, shape)]
            weights = {n: torch.empty(s, dtype=d, device="cuda") for n, d, s in arg}
        elif cmd == "tensor":                   # arg: (name, rebuild args)
            name, args = arg
            weights[name].copy_(rebuild_cuda_tensor(*args))
            torch.cuda.synchronize()
        conn.send("ok")


def gpu_rows(bench: Any, sd_cpu: dict[str, torch.Tensor], model_dir: Path) -> list[Any]:
    """The GPU rows for `bench` (a `weightsync_bench.Bench`), in the order described above."""
    from torch.multiprocessing.reductions import reduce_tensor

    from weightsync_bench.measure import Row
    from weightsync_reference.processes import EngineProcess
    log, repeat, R = bench.log, bench.repeat, bench.receivers
    n = model_bytes(sd_cpu)
    sd = {k: t.cuda() for k, t in sd_cpu.items()}
    torch.cuda.synchronize()
    rows: list[Row] = []
    name = torch.cuda.get_device_name(0)
    log(f"GPU rows on {name}")

    def add(label: str, kind: str, receivers: int, best: float, runs: list[float], peak: int,
            detail: dict[str, Any] | None = None) -> None:
        row = Row(label, kind, n, receivers, best, runs, peak, {"device": "cuda", **(detail or {})})
        rows.append(row)
        log(f"  {label:<40} {best:8.4f} s  {row.gbps:7.1f} GB/s  peak extra GPU "
            f"{peak / 2**20:8.1f} MiB")

    flat = torch.empty(n, dtype=torch.uint8, device="cuda")
    off = 0
    for t in sd.values():
        k = t.numel() * t.element_size()
        flat[off: off + k].copy_(t.reshape(-1).view(torch.uint8))
        off += k
    dst = torch.empty_like(flat)
    best, runs = _bench_cuda(lambda: dst.copy_(flat), max(5, repeat))  # noqa: F821
    add("cuda copy floor", "floor", 1, best, runs, 0)
    del dst

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,), daemon=True)
    proc.start()

    def ask(cmd: str, arg: Any = None) -> None:
        parent.send((cmd, arg))
        if not parent.poll(600) or parent.recv() != "ok":
            raise RuntimeError(f"bench GPU receiver failed at {cmd}")
    try:
        ask("flat", reduce_tensor(flat)[1])
        best, runs = _bench_cuda(lambda: ask("copy"), max(5, repeat))
        add("cuda ipc copy (raw, 1 receiver)", "baseline", 1, best, runs, 0)
        del flat
        ask("alloc", [(k, t.dtype, tuple(t.shape)) for k, t in sd.items()])

        def per_tensor() -> None:
            for k, t in sd.items():
                ask("tensor", (k, reduce_tensor(t)[1]))
        best, runs = _bench_cuda(per_tensor, repeat)
        add("per-tensor CUDA IPC (naive, 1 receiver)", "baseline", 1, best, runs, 0)
    finally:
        parent.send(("quit", None))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    torch.cuda.empty_cache()

    engines = [EngineProcess(model_dir, name=f"bench-gpu-engine{i}", device="cuda",
                             log=bench.work / f"gpu-engine{i}.log") for i in range(R)]
    try:
        for e in engines:
            e.start(timeout=600)
        for verify in (True, False):
            label = "shm (CUDA IPC, verified)" if verify else "shm (CUDA IPC, verify off)"
            rows.append(_push_row(bench, sd, engines, label, verify, n))
    finally:
        for e in engines:
            e.stop()
    return rows


def _push_row(bench: Any, sd: dict[str, torch.Tensor], engines: list[Any], label: str,
              verify: bool, n: int) -> Any:
    from weightsync_bench.measure import Row
    from weightsync.sync.pipeline import WeightSync
    cfg = {"transport": {"kind": "shm", "options": {"device": "cuda"}}, "adapter": "reference",
           "engines": [e.spec() for e in engines],
           "exporter": {"kind": "torch", "options": {"bucket_bytes": bench.bucket}},
           "sync": {"progress": "off", "verify": verify}}
    runs: list[float] = []
    details: list[dict[str, Any]] = []
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with WeightSync.from_config(cfg) as sync:
        for k in range(bench.repeat + 1):
            bench.version = max(bench.version + 1, *(e.health()["version"] + 1 for e in engines))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = sync.push(sd, version=bench.version)
            dt = time.perf_counter() - t0
            if not r.ok or (verify and not r.verified):
                raise RuntimeError(f"bench push over CUDA IPC failed: {r.summary()}")
            if k:                       # the first push is the warm-up (segments, kernels)
                runs.append(dt)
                details.append({"stages": {s: round(v, 5) for s, v in r.seconds.items()},
                                "pause_window": round(r.pause_window, 5), "buckets": r.buckets})
    peak = torch.cuda.max_memory_allocated() - base
    best = min(range(len(runs)), key=runs.__getitem__)
    row = Row(label, "transport", n, len(engines), runs[best], runs, peak,
              {"device": "cuda", **details[best]})
    bench.log(f"  {label:<40} {row.seconds:8.4f} s  {row.gbps:7.1f} GB/s  peak extra GPU "
              f"{peak / 2**20:8.1f} MiB")
    return row


def gpu_targets(rows: list[Any], bucket_unit: int) -> dict[str, Any]:
    """Issue targets for the GPU rows: CUDA IPC at >= 0.8 of the device's copy bandwidth."""
    by = {r.name: r for r in rows}
    floor = by.get("cuda copy floor")
    out: dict[str, Any] = {}
    if floor is None:
        return out
    raw = by.get("cuda ipc copy (raw, 1 receiver)")
    if raw is not None:
        v = round(floor.seconds / raw.seconds, 3)
        out["cuda_ipc_vs_device_copy"] = {"value": v, "target": 0.8, "direction": ">=",
                                           "met": v >= 0.8}
    push = by.get("shm (CUDA IPC, verified)")
    if push is not None:
        out["cuda_ipc_push_vs_device_copy"] = {
            "value": round(floor.seconds / push.seconds, 3), "target": None,
            "note": "whole verified push (pack copy, staging copy, mlh digests on both sides, "
                    "control round trips) against one bare device copy"}
        naive = by.get("per-tensor CUDA IPC (naive, 1 receiver)")
        if naive is not None:
            out["cuda_ipc_push_vs_per_tensor_ipc"] = {
                "value": round(naive.seconds / push.seconds, 3), "target": None,
                "note": f"per-tensor IPC has 1 receiver, the push {push.receivers}"}
        peak = round(push.peak_extra_bytes / bucket_unit, 2)
        out["cuda_sender_peak_extra_in_buckets"] = {
            "value": peak, "target": 2.0, "direction": "<=", "met": peak <= 2.0}
    return out
