"""`weightsync bench`: one run measures, on this machine and for the same synthetic models,

- floors: one memcpy of the model; per transport for N receivers the least its carry needs: shm
  (N + 1) copies at memcpy speed (into shared memory, and each receiver's out of it), http one
  raw loopback TCP stream of the model's bytes to each receiver (plain sockets, no framing),
  collective one raw gloo broadcast of the model as a single tensor (also with 1 receiver);
- the naive baselines users have today: save a full safetensors checkpoint and load it in every
  receiver; a torch.distributed gloo broadcast per tensor (LLM-shaped, small-tensor and MoE
  models);
- every installed weightsync transport that a reference engine can receive, end to end
  (`WeightSync.push` into `--receivers` reference-engine processes: health, export, encode,
  carry, stage, digest, verify, pause, commit, resume), with verification and without it
  (`verify: false` and no digest on either end), on the LLM-shaped model, the small-tensor one
  and an MoE-shaped one; the pause window of every push;
- the `delta` encoding over http and shm at 1 % density, when a plugin registers it;
- the rows installed plugins add through the `register_bench_rows` hook (disk_delta's publish +
  pull + apply against a full safetensors checkpoint).

Every row is run once untimed (page faults, group creation, compilation, connection setup) and
then timed `--repeat` times; the best is reported, as the steady state of a training run. Each
row's ratio is to its own floor; the targets of issue 17 are written into the JSON as met or
missed, and a verdict per target is printed at the end.

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
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from weightsync.config import parse_bytes as parse_size
from weightsync.sync.assembly import missing
from weightsync_bench.floors import Baselines, _memcpy_floor, _one_core_rows
from weightsync_bench.measure import MOE, PIDS, Row, exact_malloc, loadavg, timed
from weightsync_bench.model import model_bytes, moe_model, small_tensors_model, synthetic_model
from weightsync_bench.transport_rows import TransportRows
from weightsync_bench.verdicts import bar_chart, cpu_targets, table, verdicts

RESULTS = Path("benchmarks/results")


# -- the bench --------------------------------------------------------------------------------
class Bench(Baselines, TransportRows):
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
        self.loads: list[float] = []
        self.extra_targets: dict[str, Any] = {}    # targets that plugin rows add

    def transports(self) -> list[str]:
        from weightsync.plugins import load_components
        comps = load_components()
        ref = comps.adapters.get("reference")
        usable = [n for n, t in comps.transports.items()
                  if not missing(ref, t) and not t.publish_only]
        if self.args.transports:
            wanted = [t.strip() for t in self.args.transports.split(",") if t.strip()]
            unknown = [t for t in wanted if t not in usable]
            if unknown:
                raise SystemExit(f"transports {unknown} are not installed or cannot reach a "
                                 f"reference engine; usable: {usable}")
            return wanted
        return usable

    @staticmethod
    def has_plugin(name: str) -> bool:
        from weightsync.plugins import load_components
        comps = load_components()
        return name in comps.encodings or name in comps.transports

    @staticmethod
    def plugin_rows(pm: Any = None) -> list[Callable[[Bench, dict[str, torch.Tensor]], None]]:
        """The rows plugins add through `register_bench_rows` (of `pm`, default: the installed
        plugins), each a callable that appends its Rows (and targets, in `extra_targets`) to the
        running Bench."""
        from weightsync.plugins import make_plugin_manager
        found: list[Callable[[Bench, dict[str, torch.Tensor]], None]] = []
        (pm or make_plugin_manager()).hook.register_bench_rows(register=found.append)
        return found

    def moe(self) -> dict[str, torch.Tensor] | None:
        """The MoE-shaped model of issue 15 (`model.moe_model`)."""
        return moe_model(self.size)

    def run(self) -> dict[str, Any]:
        from safetensors.torch import save_file

        exact_malloc()
        torch.manual_seed(0)
        sd = synthetic_model(self.size)
        small = small_tensors_model(self.small_size)
        moe = self.moe()
        n, ns = model_bytes(sd), model_bytes(small)
        self.largest = max(t.numel() * t.element_size() for t in sd.values())
        R = self.receivers
        from weightsync.wire.digests import path
        self.log(f"weightsync bench: {n / 2**30:.3f} GiB in {len(sd)} tensors (bf16), "
                 f"{R} receivers, bucket {self.bucket / 2**20:.0f} MiB; small-tensor model "
                 f"{ns / 2**20:.0f} MiB in {len(small)} tensors"
                 + (f"; MoE model {model_bytes(moe) / 2**30:.3f} GiB in {len(moe)} tensors" if moe else "")
                 + f"; {os.cpu_count()} cores; copy + digest path: {path()}; load {loadavg():.1f}")
        model_dir = self.work / "engine-model"
        model_dir.mkdir(parents=True, exist_ok=True)
        save_file({**sd, **small}, str(model_dir / "model.safetensors"))
        moe_dir = None
        if moe:
            moe_dir = self.work / "engine-moe"
            moe_dir.mkdir(parents=True, exist_ok=True)
            save_file(moe, str(moe_dir / "model.safetensors"))

        device = getattr(self.args, "device", None) or "auto"
        gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if device in ("cpu", "auto"):
            self._cpu_rows(sd, small, moe, model_dir, moe_dir, n)
        if gpu:
            from weightsync_bench.gpu import gpu_rows
            self.rows += gpu_rows(self, sd, model_dir)
        result = self.result()
        if not getattr(self.args, "keep_workdir", False):
            shutil.rmtree(self.work, ignore_errors=True)
        return result

    def _cpu_rows(self, sd: dict[str, torch.Tensor], small: dict[str, torch.Tensor],
                  moe: dict[str, torch.Tensor] | None, model_dir: Path, moe_dir: Path | None,
                  n: int) -> None:
        from weightsync_bench.workers import Workers, unhashed_env
        from weightsync.wire.digests import warm
        R = self.receivers
        warm()
        # floor: best of several runs, measured again at the end (the machine is shared)
        PIDS[:] = []
        setup, run = _memcpy_floor(sd)
        self.rows.append(timed("memcpy floor", "floor", n, 1, run, max(3, self.repeat), setup,
                               self.log, floor="memcpy floor"))
        del setup, run
        self.rows += _one_core_rows(sd, self.repeat, self.log)
        gc.collect()

        workers = Workers(R)
        PIDS[:] = [p.pid for p in workers.procs if p.pid is not None]    # started: all set
        try:
            specs = [(k, str(t.dtype).removeprefix("torch."), list(t.shape))
                     for k, t in {**sd, **small, **{MOE + k: t for k, t in (moe or {}).items()}}.items()]
            workers.call(("alloc", specs))
            self._baselines(sd, small, moe, workers)
        finally:
            workers.close()
            PIDS[:] = []
        gc.collect()

        transports = self.transports()
        with self._engines(model_dir, "dense") as engines:
            raw: dict[str, Row] = {}
            for t in transports:
                raw[t] = self._transport(t, sd, engines, t)
                if t == "collective":
                    self._transport(t, sd, engines[:1], "collective (1 receiver)")
                    self._transport(t, small, engines, "collective (small tensors)")
            if self.has_plugin("delta"):
                for t in [t for t in ("http", "shm") if t in transports]:
                    self._delta(t, sd, engines, raw[t])
        with self._engines(model_dir, "dense-unhashed", env=unhashed_env(self.work)) as engines:
            for t in transports:
                self._transport(t, sd, engines, f"{t} (verify off)", verify=False)
        if moe and moe_dir is not None:
            with self._engines(moe_dir, "moe") as engines:
                for t in [t for t in ("collective", "shm") if t in transports]:
                    self._transport(t, moe, engines, f"{t} (MoE)")
        for rows in self.plugin_rows():
            rows(self, sd)
        setup, run = _memcpy_floor(sd)
        again = timed("memcpy floor (again, at the end)", "floor", n, 1, run, max(3, self.repeat),
                      setup, self.log)
        floor = self.rows[0]
        floor.runs += again.runs
        if again.seconds < floor.seconds:
            floor.seconds, floor.detail = again.seconds, again.detail
        # shm's floor: (N + 1) copies of the model at this machine's memcpy speed
        self.rows.insert(1, Row(f"shm floor ({R + 1} copies)", "floor", n, R, floor.seconds * (R + 1),
                                [x * (R + 1) for x in floor.runs], 0,
                                {"derived": f"{R + 1} x memcpy floor: the sender's copy into shared "
                                            f"memory and each receiver's copy out of it"},
                                floor=f"shm floor ({R + 1} copies)"))

    class _Engines:
        def __init__(self, bench: Bench, model_dir: Path, tag: str, env: dict[str, str] | None) -> None:
            from weightsync_reference.processes import EngineProcess
            self.engines = [EngineProcess(model_dir, name=f"bench-{tag}{i}", env=env,
                                          log=bench.work / f"engine-{tag}{i}.log")
                            for i in range(bench.receivers)]

        def __enter__(self) -> list[Any]:
            try:
                for e in self.engines:
                    e.start(timeout=300)
            except BaseException:
                self.__exit__()
                raise
            PIDS[:] = [e.proc.pid for e in self.engines if e.proc is not None]    # all started
            return self.engines

        def __exit__(self, *exc: object) -> None:
            PIDS[:] = []
            for e in self.engines:
                e.stop()
            gc.collect()

    def _engines(self, model_dir: Path, tag: str, env: dict[str, str] | None = None) -> Bench._Engines:
        return Bench._Engines(self, model_dir, tag, env)


    # -- results ------------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        floors: dict[str, Row] = {}          # per device: the first floor, one bare copy
        for r in self.rows:
            if r.kind == "floor":
                floors.setdefault(r.detail.get("device", "cpu"), r)
        memcpy = next(iter(floors.values()))
        by = {r.name: r for r in self.rows}
        rows = []
        for r in self.rows:
            d = asdict(r)
            d["gbps"] = round(r.gbps, 4)
            f = floors.get(r.detail.get("device", "cpu"), memcpy)
            d["ratio_to_memcpy"] = round(r.gbps / f.gbps, 4) if f.gbps else None
            own = by.get(r.floor) if r.floor else None
            d["ratio_to_floor"] = round(r.gbps / own.gbps, 4) if own is not None and own.gbps else None
            pw = r.detail.get("pause_window")
            if pw is not None:
                d["pause_window_s"] = pw
                d["pause_pct_of_push"] = round(100 * pw / r.seconds, 2) if r.seconds else None
            rows.append(d)
        targets = cpu_targets(self, by)
        if "cuda" in floors:
            from weightsync_bench.gpu import gpu_targets
            targets.update(gpu_targets([r for r in self.rows if r.detail.get("device") == "cuda"],
                                       max(self.bucket, self.largest)))
        from weightsync.wire.digests import path
        return {"size_bytes": memcpy.bytes,
                "device": (torch.cuda.get_device_name(0) if "cuda" in floors else "cpu"),
                "receivers": self.receivers, "bucket_bytes": self.bucket,
                "repeat": self.repeat, "cores": os.cpu_count(), "torch": torch.__version__,
                "python": sys.version.split()[0], "memory_method": "VmHWM after clear_refs",
                "copy_digest_path": path(), "loadavg_at_end": loadavg(),
                "rows": rows, "targets": targets, "verdicts": verdicts(targets),
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def save(result: dict[str, Any], json_path: str | None, png_path: str | None,
         chart: Callable[[dict[str, Any], Path], Any]) -> None:
    """Write a bench's result as JSON (when asked) and its chart as PNG (asked, or next to the
    JSON), saying where; shared by every benchmark that keeps results."""
    if json_path:
        p = Path(json_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {p}")
    png = png_path or (str(Path(json_path).with_suffix(".png")) if json_path else None)
    if png:
        chart(result, Path(png))
        print(f"wrote {png}")


def run_bench(args: argparse.Namespace) -> int:
    bench = Bench(args)
    result = bench.run()
    print()
    print(table(result))
    save(result, args.json, args.png, bar_chart)
    return 0
