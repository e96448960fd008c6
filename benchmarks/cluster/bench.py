"""The cluster bench: push seconds and the trainer's egress against the number of members, on an
emulated cluster of network namespaces with every link shaped by tc tbf (`weightsync.testing.
netns`): the trainer on a host of its own, each reference engine on its own, and every byte
between them through a shaped link into one bridge.

    sudo .venv/bin/python benchmarks/cluster/bench.py --members 1,2,4,8,16 \
        --json benchmarks/cluster/results.json           # PNG next to it

This process (root namespace) writes the synthetic model, builds the cluster and runs
`worker.py` inside the trainer's namespace; the worker starts the engines in theirs, measures
and writes JSON; this process adds the model's predictions (`model.py`), prints the table and
writes the JSON and the PNG. `--senders 2,4` instead runs R trainer ranks on R hosts with
`sync.senders: all` beside `rank0` (`senders.py`; JSON and table only). Without root or iproute2
it prints why it skipped and exits 0: it never prints numbers it did not measure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import senders
from model import predict
from model import table as model_table
from worker import ENCODINGS, SHAPES

from weightsync_bench.harness import save


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", default="1,2,4,8,16", help="comma list of fleet sizes N")
    p.add_argument("--shape", default="star", help=f"comma list of shapes: {', '.join(SHAPES)}")
    p.add_argument("--encodings", default="raw,delta", help=f"comma list: {', '.join(ENCODINGS)}")
    p.add_argument("--size", default="64MiB", help="model size (bf16, LLM shapes)")
    p.add_argument("--bucket", default=None, help="exporter bucket size (default: the exporter's)")
    p.add_argument("--rate", default="400mbit", help="every link's rate, both directions (tc)")
    p.add_argument("--latency", default="20ms", help="tbf's queue bound on every link end")
    p.add_argument("--repeat", type=int, default=3, help="timed pushes per row, after one warm-up")
    p.add_argument("--piece", default="256KiB", help="chain/tree: bytes per forwarded piece "
                                                   "(and the relay floor's reads)")
    p.add_argument("--senders", default=None, help="comma list of trainer ranks R (one host each, "
                   "senders: all beside rank0; `senders.py`); default: one trainer, as always")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--png", default=None, help="write the chart here (default: next to --json)")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, removed)")
    args = p.parse_args(argv)
    args.members = sorted({int(x) for x in args.members.split(",") if x.strip()})
    args.shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
    args.encodings = [e.strip() for e in args.encodings.split(",") if e.strip()]
    args.senders = sorted({int(x) for x in args.senders.split(",") if x.strip()}) \
        if args.senders else None
    from weightsync.config import parse_bytes
    args.piece_bytes = parse_bytes(args.piece)
    if args.senders and (min(args.senders) < 1 or args.encodings != ["raw"]
                         or any(s not in ("star", "chain", "tree") for s in args.shapes)):
        p.error("--senders needs ranks of at least 1, shapes among star, chain, tree and "
                "--encodings raw")
    if not args.members or min(args.members) < 1:
        p.error(f"--members needs sizes of at least 1, got {args.members}")
    for what, got, known in (("shape", args.shapes, SHAPES), ("encoding", args.encodings, ENCODINGS)):
        unknown = [x for x in got if x not in known]
        if unknown:
            p.error(f"unknown {what} {unknown}; this transport supports: {', '.join(known)}")
    return args


def write_model(size: str, path: Path) -> int:
    from safetensors.torch import save_file
    from weightsync_bench.model import model_bytes, synthetic_model
    from weightsync.config import parse_bytes
    sd = synthetic_model(parse_bytes(size))
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))
    return model_bytes(sd)


def with_ratios(result: dict[str, Any]) -> None:
    one, model = result["link"]["one_copy_s"], result["model_bytes"]
    # the link's line time: the model's bytes at the shaped rate, no header counted
    result["link"]["line_s"] = round(model / result["cluster"]["rate_bytes"], 4)
    for r in result["rows"]:
        r["x_one_copy"] = round(r["seconds"] / one, 3)
        r["egress_x_model"] = round(r["egress_bytes"] / model, 3)
    for r in result.get("relay_floor", []):
        r["x_one_copy"] = round(r["seconds"] / one, 3)


def table(result: dict[str, Any]) -> str:
    one = result["link"]["one_copy_s"]
    head = (f"one copy over one link: {one:.3f} s ({result['model_bytes'] / 2**20:.0f} MiB at "
            f"{result['cluster']['rate']}: plain TCP; the line time without headers is "
            f"{result['link']['line_s']:.3f} s)")
    lines = [head, "",
             "| N | shape | encoding | push s | push / one copy | trainer egress / model bytes |",
             "|---:|---|---|---:|---:|---:|"]
    lines += [f"| {r['members']} | {r['shape']} | {r['encoding']} | {r['seconds']:.3f} | "
              f"{r['x_one_copy']:.2f} | {r['egress_x_model']:.3f} |" for r in result["rows"]]
    if result.get("relay_floor"):
        floor = {r["members"]: r for r in result["relay_floor"]}
        lines += ["", "relay floor (plain TCP forwarders down a chain of N member hosts, "
                      f"{result['relay_floor'][0]['piece_bytes'] >> 10} KiB reads), and each "
                      "relay row against it:", "",
                  "| N | floor s | floor / one copy | " + " | ".join(
                      f"{s} {e} / floor" for s, e in _relayed(result)) + " |",
                  "|---:|---:|---:|" + "---:|" * len(_relayed(result))]
        for n, f in sorted(floor.items()):
            cells = []
            for s, e in _relayed(result):
                r = next((r for r in result["rows"] if (r["members"], r["shape"], r["encoding"])
                          == (n, s, e)), None)
                cells.append(f"{r['seconds'] / f['seconds']:.2f}" if r else "")
            lines.append(f"| {n} | {f['seconds']:.3f} | {f['x_one_copy']:.2f} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def _relayed(result: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted({(r["shape"], r["encoding"]) for r in result["rows"] if r["shape"] != "star"})


def chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_s, ax_e) = plt.subplots(1, 2, figsize=(11, 4.2))
    one = result["link"]["one_copy_s"]
    lines: dict[str, list[dict[str, Any]]] = {}
    for r in result["rows"]:
        lines.setdefault(f"{r['shape']} {r['encoding']}", []).append(r)
    ns = sorted({r["members"] for r in result["rows"]})
    for label, rows in lines.items():
        rows.sort(key=lambda r: r["members"])
        x = [r["members"] for r in rows]
        ax_s.plot(x, [r["seconds"] for r in rows], marker="o", label=label)
        ax_e.plot(x, [r["egress_x_model"] for r in rows], marker="o", label=label)
    floor = sorted(result.get("relay_floor", []), key=lambda r: r["members"])
    if floor:
        ax_s.plot([r["members"] for r in floor], [r["seconds"] for r in floor], color="black",
                  ls="-.", marker="x", label="relay floor (plain TCP chain)")
    ax_s.axhline(one, color="gray", ls="--", label="one copy over one link")
    ax_s.plot(ns, [n * one for n in ns], color="gray", ls=":", label="N x one copy")
    ax_e.axhline(1.0, color="gray", ls="--", label="one model")
    for ax, title, ylabel in ((ax_s, "push seconds", "seconds"),
                              (ax_e, "trainer egress", "egress / model bytes")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("members N")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['model_bytes'] / 2**20:.0f} MiB model, every link "
                 f"{result['cluster']['rate']} (tc tbf, both directions)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync_bench.netns import DEV, Cluster
    if "nixl" in args.shapes:     # UCX over TCP on each host's own link (inherited by every host)
        os.environ.setdefault("UCX_TLS", "tcp")
        os.environ.setdefault("UCX_NET_DEVICES", DEV)
    if "delta" in args.encodings:
        from weightsync.plugins import load_components
        if "delta" not in load_components().encodings:
            raise SystemExit("encoding delta needs the disk_delta plugin: pip install "
                             "./plugins/disk_delta (or leave it out: --encodings raw)")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="weightsync-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        size = write_model(args.size, work / "model")
        print(f"cluster bench: {size / 2**20:.0f} MiB model, members {args.members}, shapes "
              f"{args.shapes}, encodings {args.encodings}, links {args.rate}", flush=True)
        t0 = time.perf_counter()
        hosts = ["trainer"] + [f"e{i}" for i in range(max(args.members))]
        with Cluster(hosts, rate=args.rate, latency=args.latency) as c:
            spec = {"cluster": c.spec(), "workdir": str(work), "members": args.members,
                    "shapes": args.shapes, "encodings": args.encodings, "repeat": args.repeat,
                    "bucket": args.bucket, "piece_bytes": args.piece_bytes,
                    "out": str(work / "worker.json")}
            (work / "spec.json").write_text(json.dumps(spec))
            r = c.run("trainer", [sys.executable, str(HERE / "worker.py"), str(work / "spec.json")])
            if r.returncode != 0:
                raise SystemExit(f"the trainer's worker failed ({r.returncode}); engine logs are "
                                 f"in {work} (rerun with --workdir to keep them)")
        result = json.loads((work / "worker.json").read_text())
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    result["cluster"] = {k: v for k, v in spec["cluster"].items() if k != "hosts"}
    result["cluster"]["hosts"] = len(hosts)
    with_ratios(result)
    result.update({"members": args.members, "shapes": args.shapes, "encodings": args.encodings,
                   "repeat": args.repeat, "cores": os.cpu_count(), "kernel": platform.release(),
                   "loadavg_at_end": round(os.getloadavg()[0], 2),
                   "wall_s": round(time.perf_counter() - t0, 1),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    result["piece_bytes"] = args.piece_bytes
    result["model"] = {e: predict(result, e) for e in args.encodings
                       if any(r["members"] == 1 and r["encoding"] == e for r in result["rows"])}
    return result


def run_senders(args: argparse.Namespace) -> dict[str, Any]:
    """`--senders`: R trainer ranks on R hosts, senders all beside rank0 (`senders.py`)."""
    from weightsync_bench.netns import Cluster
    work = Path(args.workdir or tempfile.mkdtemp(prefix="weightsync-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        size = write_model(args.size, work / "model")
        print(f"cluster bench --senders {args.senders}: {size / 2**20:.0f} MiB model, members "
              f"{args.members}, shapes {args.shapes}, links {args.rate}", flush=True)
        hosts = senders.hosts(args)
        with Cluster(hosts, rate=args.rate, latency=args.latency) as c:
            result = senders.run(c, args, work)
            cluster = {k: v for k, v in c.spec().items() if k != "hosts"}
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    result.update({"model_bytes": size, "cluster": {**cluster, "hosts": len(hosts)},
                   "senders": args.senders, "members": args.members, "shapes": args.shapes,
                   "encodings": ["raw"], "repeat": args.repeat, "piece_bytes": args.piece_bytes,
                   "cores": os.cpu_count(), "kernel": platform.release(),
                   "loadavg_at_start": args.load0, "loadavg_at_end": round(os.getloadavg()[0], 2),
                   "wall_s": round(time.perf_counter() - t0, 1),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from weightsync_bench.netns import NetnsUnavailable, probe
    try:
        probe()
    except NetnsUnavailable as e:
        print(f"cluster bench skipped: {e}")
        return 0
    if args.senders:
        args.load0 = round(os.getloadavg()[0], 2)
        result = run_senders(args)
        print()
        print(senders.table(result))
        if args.json:                       # no chart: the table is the result
            Path(args.json).write_text(json.dumps(result, indent=2))
            print(f"\nwrote {args.json}")
        return 0
    result = run(args)
    print()
    print(table(result))
    for pred in result["model"].values():
        print()
        print(model_table(pred))
    save(result, args.json, args.png, chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
