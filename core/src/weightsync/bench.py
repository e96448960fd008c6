"""`weightsync bench`: one run measures, on this machine and for the same synthetic model,
- the memcpy floor (copying the model's bytes once into preallocated memory),
- the naive baselines users have today (save a full safetensors checkpoint and load it back in
  every receiver; a torch.distributed gloo broadcast per tensor),
- one raw gloo broadcast of all the bytes as a single tensor (the ceiling a collective can reach),
- every installed weightsync transport that a reference engine can receive, end to end
  (`WeightSync.push` into `--receivers` reference-engine processes: health, pause, export,
  encode, carry, stage, verify digests, commit, resume).

Every row is run once untimed (page faults, group creation, connection setup) and then timed
`--repeat` times; the best is reported, as the steady state of a training run.

Sender peak extra memory is measured, not estimated: before a row starts the bench resets the
kernel's peak-RSS counter of its own process (`/proc/self/clear_refs` <- 5) and notes VmRSS; after
the row it reads VmHWM. The difference is what the row made the sender hold at its worst (shared
memory segments count: they are resident in the sender). Where clear_refs is unavailable, a
thread samples VmRSS every 2 ms instead.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .bench_model import model_bytes, small_tensors_model, synthetic_model
from .config import parse_bytes as parse_size

RESULTS = Path("benchmarks/results")


# -- memory -----------------------------------------------------------------------------------
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class PeakRss:
    """Peak resident memory of this process above its level at start, in bytes."""

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

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def timed(name: str, kind: str, nbytes: int, receivers: int, fn: Callable[[], Any], repeat: int,
          setup: Callable[[], Any] | None = None, log: Callable[[str], None] = print) -> Row:
    """Setup and one warm-up run, then `repeat` timed runs, all inside one peak-memory window."""
    runs: list[float] = []
    details: list[Any] = []
    with PeakRss() as mem:
        if setup is not None:
            setup()
        fn()
        for _ in range(repeat):
            t0 = time.perf_counter()
            d = fn()
            runs.append(time.perf_counter() - t0)
            details.append(d)
    best = min(range(len(runs)), key=runs.__getitem__)
    detail = details[best] if isinstance(details[best], dict) else {}
    row = Row(name, kind, nbytes, receivers, runs[best], runs, mem.extra, detail)
    log(f"  {name:<40} {row.seconds:8.3f} s  {row.gbps:6.2f} GB/s  peak extra "
        f"{row.peak_extra_bytes / 2**20:8.1f} MiB")
    return row


def _memcpy_floor(sd: dict[str, torch.Tensor]) -> tuple[Callable[[], None], Callable[[], None]]:
    dst: dict[str, torch.Tensor] = {}

    def setup() -> None:
        dst.update({n: torch.empty_like(t) for n, t in sd.items()})

    def run() -> None:
        for n, t in sd.items():
            dst[n].copy_(t)
    return setup, run


# -- the bench --------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, log: Callable[[str], None] = print) -> None:
        self.args = args
        self.log = log
        self.size = parse_size(args.size) if isinstance(args.size, str) else int(args.size)
        self.receivers = int(args.receivers)
        self.bucket = parse_size(args.bucket) if isinstance(args.bucket, str) else int(args.bucket)
        self.repeat = max(1, int(getattr(args, "repeat", 1) or 1))
        self.small_size = min(64 * 2**20, max(2**20, self.size // 8))
        self.work = Path(getattr(args, "workdir", None) or tempfile.mkdtemp(prefix="weightsync-bench-"))
        self.rows: list[Row] = []
        self.version = 0
        self.largest = 0

    def transports(self) -> list[str]:
        from .plugins import load_components
        comps = load_components()
        ref = comps.adapters.get("reference")
        usable = [n for n, t in comps.transports.items()
                  if t.requires in ref.capabilities and not t.publish_only]
        if self.args.transports:
            wanted = [t.strip() for t in self.args.transports.split(",") if t.strip()]
            unknown = [t for t in wanted if t not in usable]
            if unknown:
                raise SystemExit(f"transports {unknown} are not installed or cannot reach a "
                                 f"reference engine; usable: {usable}")
            return wanted
        return usable

    def run(self) -> dict[str, Any]:
        from safetensors.torch import save_file

        exact_malloc()
        torch.manual_seed(0)
        sd = synthetic_model(self.size)
        small = small_tensors_model(self.small_size)
        n, ns = model_bytes(sd), model_bytes(small)
        self.largest = max(t.numel() * t.element_size() for t in sd.values())
        R = self.receivers
        self.log(f"weightsync bench: {n / 2**30:.3f} GiB in {len(sd)} tensors (bf16), "
                 f"{R} receivers, bucket {self.bucket / 2**20:.0f} MiB; small-tensor model "
                 f"{ns / 2**20:.0f} MiB in {len(small)} tensors; {os.cpu_count()} cores")
        model_dir = self.work / "engine-model"
        model_dir.mkdir(parents=True, exist_ok=True)
        save_file({**sd, **small}, str(model_dir / "model.safetensors"))
        specs = [(k, str(t.dtype).removeprefix("torch."), list(t.shape)) for k, t in {**sd, **small}.items()]

        device = getattr(self.args, "device", None) or "auto"
        gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if device in ("cpu", "auto"):
            self._cpu_rows(sd, small, model_dir, specs, n)
        if gpu:
            from .bench_gpu import gpu_rows
            self.rows += gpu_rows(self, sd, model_dir)
        result = self.result()
        if not getattr(self.args, "keep_workdir", False):
            shutil.rmtree(self.work, ignore_errors=True)
        return result

    def _cpu_rows(self, sd: dict[str, torch.Tensor], small: dict[str, torch.Tensor], model_dir: Path,
                  specs: list[Any], n: int) -> None:
        from .bench_workers import Workers
        from .testing.engines import EngineProcess
        R = self.receivers
        # floor: best of several runs, measured again at the end (the machine is shared)
        setup, run = _memcpy_floor(sd)
        self.rows.append(timed("memcpy floor", "floor", n, 1, run, max(3, self.repeat), setup, self.log))
        del setup, run
        gc.collect()

        workers = Workers(R)
        engines: list[EngineProcess] = []
        try:
            workers.call(("alloc", specs))
            self._baselines(sd, small, workers)
            workers.close()
            engines = [EngineProcess(model_dir, name=f"bench-engine{i}",
                                     log=self.work / f"engine{i}.log") for i in range(R)]
            for e in engines:
                e.start(timeout=300)
            for t in self.transports():
                self._transport(t, sd, engines, f"{t}")
                if t == "collective":
                    self._transport(t, sd, engines[:1], "collective (1 receiver)")
                    self._transport(t, small, engines, "collective (small tensors)")
        finally:
            workers.close()
            for e in engines:
                e.stop()
        setup, run = _memcpy_floor(sd)
        again = timed("memcpy floor (again, at the end)", "floor", n, 1, run, max(3, self.repeat), setup, self.log)
        floor = self.rows[0]
        floor.runs += again.runs
        floor.seconds = min(floor.seconds, again.seconds)

    def _baselines(self, sd: dict[str, torch.Tensor], small: dict[str, torch.Tensor], workers: Any) -> None:
        from safetensors.torch import save_file

        from .testing.engines import free_port
        from .transports import pg as pgs
        R, n = self.receivers, model_bytes(sd)
        ckpt = self.work / "ckpt" / "model.safetensors"
        ckpt.parent.mkdir(parents=True, exist_ok=True)

        def save_load() -> dict[str, Any]:
            t0 = time.perf_counter()
            save_file(sd, str(ckpt))
            t_save = time.perf_counter() - t0
            loads = workers.call(("load", str(ckpt)))
            return {"save_s": t_save, "load_s": max(loads)}
        self.rows.append(timed("safetensors save+load (naive)", "baseline", n, R, save_load,
                               self.repeat, None, self.log))
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
            def per_tensor(model: dict[str, torch.Tensor]) -> Callable[[], None]:
                def go() -> None:
                    names = list(model)
                    idx = workers.post(("per_tensor", ("all", names)))
                    for k in names:
                        pgs.broadcast(groups["all"], model[k], 600)
                    workers.wait(idx)
                return go
            self.rows.append(timed("gloo broadcast per tensor (naive)", "baseline", n, R,
                                   per_tensor(sd), self.repeat, None, self.log))
            self.rows.append(timed("gloo broadcast per tensor (small tensors)", "baseline",
                                   model_bytes(small), R, per_tensor(small), self.repeat, None, self.log))
            flat: list[torch.Tensor] = []

            def single(key: str, count: int) -> Callable[[], None]:
                def go() -> None:
                    if not flat:
                        flat.append(torch.empty(n, dtype=torch.uint8))
                        off = 0
                        for t in sd.values():    # the model's bytes as one tensor
                            k = t.numel() * t.element_size()
                            flat[0][off: off + k].copy_(t.reshape(-1).view(torch.uint8))
                            off += k
                    idx = workers.post(("single", (key, n)), only=count)
                    pgs.broadcast(groups[key], flat[0], 600)
                    workers.wait(idx)
                return go
            self.rows.append(timed("gloo broadcast, 1 tensor (raw)", "baseline", n, R,
                                   single("all", R), self.repeat, None, self.log))
            self.rows.append(timed("gloo broadcast, 1 tensor (raw, 1 receiver)", "baseline", n, 1,
                                   single("one", 1), self.repeat, None, self.log))
            flat.clear()
        finally:
            for g in groups.values():
                pgs.forget(g)

    def _transport(self, kind: str, sd: dict[str, torch.Tensor], engines: list[Any], label: str) -> None:
        from .pipeline import WeightSync
        opts: dict[str, Any] = {"timeout": 600} if kind == "collective" else {}
        if kind == "shm":
            opts["device"] = "cpu"
        cfg = {"transport": {"kind": kind, "options": opts}, "adapter": "reference",
               "engines": [e.spec() for e in engines],
               "exporter": {"kind": "torch", "options": {"bucket_bytes": self.bucket}},
               "sync": {"progress": "off"}}
        holder: dict[str, Any] = {}

        def setup() -> None:
            holder["sync"] = WeightSync.from_config(cfg)

        def push() -> dict[str, Any]:
            sync = holder["sync"]
            self.version = max(self.version + 1, *(e.health()["version"] + 1 for e in engines))
            r = sync.push(sd, version=self.version)
            if not (r.ok and r.verified):
                raise RuntimeError(f"bench push over {kind} failed: {r.summary()}")
            return {"stages": {k: round(v, 4) for k, v in r.seconds.items()},
                    "buckets": r.buckets, "wire_bytes": r.wire_bytes}
        try:
            row = timed(label, "transport", model_bytes(sd), len(engines), push, self.repeat, setup, self.log)
        finally:
            if "sync" in holder:
                holder["sync"].close()
        self.rows.append(row)

    # -- results ------------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        floors = {r.detail.get("device", "cpu"): r for r in self.rows if r.kind == "floor"}
        floor = next(iter(floors.values()))
        by = {r.name: r for r in self.rows}
        rows = []
        for r in self.rows:
            d = asdict(r)
            d["gbps"] = round(r.gbps, 4)
            f = floors.get(r.detail.get("device", "cpu"), floor)
            d["ratio_to_floor"] = round(r.gbps / f.gbps, 4) if f.gbps else None
            rows.append(d)
        targets: dict[str, Any] = {}
        if "shm" in by:
            targets["shm_vs_floor"] = {"value": rows[self.rows.index(by["shm"])]["ratio_to_floor"],
                                       "target": 0.5}
        if "collective (1 receiver)" in by and "gloo broadcast, 1 tensor (raw, 1 receiver)" in by:
            c, g = by["collective (1 receiver)"], by["gloo broadcast, 1 tensor (raw, 1 receiver)"]
            targets["collective_1rx_vs_raw_gloo_1rx"] = {"value": round(c.gbps / g.gbps, 4), "target": 0.8}
        if "collective (small tensors)" in by and "gloo broadcast per tensor (small tensors)" in by:
            c, p = by["collective (small tensors)"], by["gloo broadcast per tensor (small tensors)"]
            targets["collective_vs_per_tensor_small"] = {"value": round(p.seconds / c.seconds, 3),
                                                         "target": 3.0}
        if "collective" in by and "gloo broadcast per tensor (naive)" in by:
            targets["collective_vs_per_tensor_llm"] = {
                "value": round(by["gloo broadcast per tensor (naive)"].seconds / by["collective"].seconds, 3),
                "target": None}
        # a tensor larger than the bucket travels alone: the largest payload is the real unit
        unit = max(self.bucket, self.largest)
        mem = {r.name: round(r.peak_extra_bytes / unit, 2) for r in self.rows
               if r.kind == "transport" and r.detail.get("device", "cpu") == "cpu"}
        targets["sender_peak_extra_in_buckets"] = {
            "value": mem, "target": 2.0, "bucket_unit_bytes": unit,
            "note": "unit = max(bucket_bytes, largest tensor), the largest payload a sync carries"}
        if "cuda" in floors:
            from .bench_gpu import gpu_targets
            targets.update(gpu_targets([r for r in self.rows if r.detail.get("device") == "cuda"], unit))
        return {"size_bytes": floor.bytes, "device": (torch.cuda.get_device_name(0) if "cuda" in floors
                                                        else "cpu"), "receivers": self.receivers, "bucket_bytes": self.bucket,
                "repeat": self.repeat, "cores": os.cpu_count(), "torch": torch.__version__,
                "python": sys.version.split()[0], "memory_method": "VmHWM after clear_refs",
                "rows": rows, "targets": targets,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def table(result: dict[str, Any]) -> str:
    head = f"{'method':<42} {'recv':>4} {'seconds':>9} {'GB/s':>7} {'x floor':>8} {'sender peak extra':>18}"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(f"{r['name']:<42} {r['receivers']:>4} {r['seconds']:>9.3f} {r['gbps']:>7.2f} "
                     f"{r['ratio_to_floor']:>8.2f} {r['peak_extra_bytes'] / 2**20:>14.1f} MiB")
    lines.append("")
    for k, v in result["targets"].items():
        if k == "sender_peak_extra_in_buckets":
            lines.append(f"{k}: " + ", ".join(f"{n}={x}" for n, x in v["value"].items())
                         + f" (target <= {v['target']})")
        else:
            lines.append(f"{k}: {v['value']}" + (f" (target >= {v['target']})" if v["target"] else ""))
    return "\n".join(lines)


def bar_chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    colors = {"floor": "#555555", "baseline": "#d98c3f", "transport": "#3f7fd9"}
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    names = [f"{r['name']} ({r['receivers']} rx)" for r in rows]
    vals = [r["gbps"] for r in rows]
    ax.barh(names, vals, color=[colors[r["kind"]] for r in rows])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (model bytes / end-to-end seconds; higher is better)")
    ax.set_title(f"weightsync bench: {result['size_bytes'] / 2**30:.2f} GiB bf16, "
                 f"{result['receivers']} receivers, {result['cores']} cores")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench(args: argparse.Namespace) -> int:
    bench = Bench(args)
    result = bench.run()
    print()
    print(table(result))
    if args.json:
        p = Path(args.json)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {p}")
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        bar_chart(result, Path(png))
        print(f"wrote {png}")
    return 0
