"""The cluster bench's `--senders R1,R2,..`: R trainer ranks on R trainer hosts (t0..t{R-1}, each
its own shaped link) push the same model into N engines, with `sync.senders: all` (every rank
sends the buckets it owns) and, on the same run, `senders: rank0` (rank 0 sends everything).

`bench.py` builds one cluster (t0..t{max R-1}, the engine hosts, and a host `ctl` that only starts
the engines), then calls `run` here: it starts `senders.py engines SPEC` in ctl's namespace, and
for each R, R processes `senders.py rank SPEC` (one per trainer host, a gloo group over the hosts'
links, rendezvous at t0's address). Every rank loads the state dict from the bench's
model.safetensors; rank 0 times each push and reads every trainer link's tx counter around it.

The copies a push owes: star sends every engine its own copy (N), chain and tree send one (the
engines relay). `busiest / copies` is the busiest trainer link's bytes per push over
copies x model bytes; the acceptance (issue 41 item 4) is busiest / copies <= 1.2 / R.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PORT = 8100
MASTER_PORT = 29400


def log(msg: str) -> None:
    print(f"[senders] {msg}", flush=True)


def copies(shape: str, members: int) -> int:
    return members if shape == "star" else 1


# -- the root namespace's side (called by bench.py) ----------------------------------------------
def hosts(args: Any) -> list[str]:
    return [f"t{r}" for r in range(max(args.senders))] + [f"e{i}" for i in range(max(args.members))] \
        + ["ctl"]


def _wait(procs: list[subprocess.Popen], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{what}: still running after {timeout:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise SystemExit(f"{what} failed (exit codes {[p.returncode for p in procs]})")


def run(c: Any, args: Any, work: Path) -> dict[str, Any]:
    """Every R of `args.senders` against the engines of `c`; the rows, for `table`."""
    spec = {"cluster": c.spec(), "workdir": str(work), "members": args.members,
            "shapes": args.shapes, "repeat": args.repeat, "bucket": args.bucket,
            "piece_bytes": args.piece_bytes}
    (work / "spec.json").write_text(json.dumps(spec))
    ready = work / "engines.ready"
    ctl = c.popen("ctl", [sys.executable, __file__, "engines", str(work / "spec.json")],
                  stdin=subprocess.PIPE)
    rows: list[dict[str, Any]] = []
    warnings: list[str] = []
    try:
        deadline = time.monotonic() + 900
        while not ready.exists():
            if ctl.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the engines did not start; logs in {work}")
            time.sleep(0.2)
        for i, world in enumerate(args.senders):
            out = work / f"rows-{world}.json"
            env = {**os.environ, "MASTER_ADDR": c.addr("t0"), "MASTER_PORT": str(MASTER_PORT + i),
                   "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": spec["cluster"]["dev"],
                   "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, __file__, "rank", str(work / "spec.json"), str(world),
                   str(1000 * (i + 1)), str(out)]
            log(f"R={world}: {world} rank process(es) on t0..t{world - 1}")
            errs = [open(work / f"rank{r}-of-{world}.log", "w") for r in range(world)]
            try:
                procs = [c.popen(f"t{r}", cmd, env={**env, "RANK": str(r)}, stderr=errs[r])
                         for r in range(world)]
                _wait(procs, f"the R={world} ranks (logs: {work}/rank*-of-{world}.log)", 1800)
            finally:
                for f in errs:
                    f.close()
            rows += json.loads(out.read_text())
            warned = [f"R={world} rank {r}: {line.strip()}" for r in range(world)
                      for line in (work / f"rank{r}-of-{world}.log").read_text().splitlines()
                      if "WARNING" in line or "Error" in line]
            warnings += warned[:40]
            for line in warned[:10]:
                log(line[:300])
        for f in sorted(work.glob("engine-*.log")):    # the relays the engines refused
            warnings += [f"{f.stem}: {line.strip()[:300]}" for line in f.read_text().splitlines()
                         if "relay refused" in line or "stalled" in line][:20]
    finally:
        if ctl.poll() is None:
            ctl.stdin.close()               # the engines stop on EOF
            try:
                ctl.wait(timeout=60)
            except subprocess.TimeoutExpired:
                ctl.kill()
    return {"rows": rows, "warnings": warnings}


def table(result: dict[str, Any]) -> str:
    model = result["model_bytes"]
    lines = ["| R | N | shape | senders | push s | busiest trainer link / model | "
             "each trainer link / model | busiest / copies | (busiest / copies) / (1/R) |",
             "|---:|---:|---|---|---:|---:|---|---:|---:|"]
    for r in result["rows"]:
        each = ", ".join(f"{b / model:.2f}" for b in r["link_bytes"])
        lines.append(f"| {r['ranks']} | {r['members']} | {r['shape']} | {r['senders']} | "
                     f"{r['seconds']:.3f} | {r['busiest'] / model:.3f} | {each} | "
                     f"{r['busiest_per_copy']:.3f} | {r['x_share']:.2f} |")
    return "\n".join(lines)


# -- inside the cluster --------------------------------------------------------------------------
def engines_main(spec_path: str) -> int:
    """In ctl's namespace: start one reference engine per engine host; stop them on stdin EOF."""
    from weightsync_reference.processes import EngineProcess, start_all
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["workdir"])
    names = [f"e{i}" for i in range(max(spec["members"]))]
    hosts_ = spec["cluster"]["hosts"]
    engines = [EngineProcess(work / "model", host=hosts_[h]["addr"], port=PORT, name=h,
                             log=work / f"engine-{h}.log",
                             program=["ip", "netns", "exec", hosts_[h]["ns"], sys.executable,
                                      "-m", "weightsync"]) for h in names]
    t0 = time.perf_counter()
    start_all(engines, timeout=900)
    log(f"{len(engines)} engines up in {time.perf_counter() - t0:.1f} s")
    (work / "engines.ready").write_text("ok")
    try:
        sys.stdin.read()
    finally:
        for e in engines:
            e.stop()
    return 0


def rank_main(spec_path: str, world: int, version: int, out: str) -> int:
    """One trainer rank: every (N, shape, senders) row, the same pushes on every rank."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from weightsync import WeightSync
    from weightsync_bench.model import model_bytes
    from weightsync_bench.netns import link_bytes

    from worker import SHAPES, merged
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    hosts_ = spec["cluster"]["hosts"]
    if world > 1:
        dist.init_process_group("gloo")
    me = dist.get_rank() if world > 1 else 0
    sd = load_file(str(Path(spec["workdir"]) / "model" / "model.safetensors"))
    size = model_bytes(sd)
    trainers = [hosts_[f"t{r}"]["ns"] for r in range(world)]
    rows = []
    for members in spec["members"]:
        engines = [{"url": f"http://{hosts_[f'e{i}']['addr']}:{PORT}", "name": f"e{i}"}
                   for i in range(members)]
        for shape in spec["shapes"]:
            for senders in (("all", "rank0") if world > 1 else ("rank0",)):
                cfg: dict[str, Any] = {"adapter": "reference", "engines": engines,
                                       "sync": {"progress": "off", "senders": senders}}
                if spec["bucket"]:
                    cfg["exporter"] = {"kind": "torch",
                                       "options": {"bucket_bytes": spec["bucket"]}}
                cfg = merged(cfg, SHAPES[shape])
                if shape != "star" and spec.get("piece_bytes"):
                    cfg = merged(cfg, {"transport": {"options": {
                        "piece_bytes": spec["piece_bytes"]}}})
                sync = WeightSync.from_config(cfg)
                runs = []
                try:
                    for i in range(spec["repeat"] + 1):          # the first: warm-up
                        version += 1
                        if world > 1:
                            dist.barrier()
                        tx0 = [link_bytes(ns).tx for ns in trainers] if me == 0 else []
                        t0 = time.perf_counter()
                        r = sync.push(sd, version=version)
                        dt = time.perf_counter() - t0
                        if not (r.ok and r.verified):
                            raise RuntimeError(f"push failed: {r.summary()}")
                        if me == 0 and i:
                            tx = [link_bytes(ns).tx - b for ns, b in zip(trainers, tx0)]
                            runs.append({"seconds": dt, "link_bytes": tx,
                                         "senders_report": {str(k): v for k, v
                                                            in sorted(r.senders.items())},
                                         "wire_bytes": r.wire_bytes, "stages": {
                                             k: round(v, 3) for k, v in r.seconds.items()}})
                finally:
                    sync.close()
                if me:
                    continue
                best = min(runs, key=lambda x: x["seconds"])
                busiest = max(best["link_bytes"])
                per_copy = busiest / (copies(shape, members) * size)
                rows.append({"ranks": world, "members": members, "shape": shape,
                             "senders": senders, **best, "busiest": busiest,
                             "busiest_per_copy": round(per_copy, 4),
                             "x_share": round(per_copy * world, 3),
                             "runs": [x["seconds"] for x in runs],
                             "run_stages": [x["stages"] for x in runs]})
                log(f"R={world} N={members} {shape:<5} {senders:<5} push {best['seconds']:7.3f} s  links "
                    f"{[round(b / size, 3) for b in best['link_bytes']]}  report "
                    f"{best['senders_report']}")
    if me == 0:
        Path(out).write_text(json.dumps(rows, indent=2))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if sys.argv[1] == "engines":
        sys.exit(engines_main(sys.argv[2]))
    sys.exit(rank_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
