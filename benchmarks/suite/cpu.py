"""Where the test suite's time goes: runs a command (by default the suite as `make test` runs
it) while sampling every process's CPU time from /proc, then prints the wall time, how busy the
machine's cores were, the CPU seconds by kind of process, and the slowest tests pytest listed.

    python benchmarks/suite/cpu.py --json benchmarks/suite/results.json
    python benchmarks/suite/cpu.py -- .venv/bin/python -m pytest -n 2 --dist loadscope tests

On a machine whose cores stay busy the whole run, wall time cannot fall below CPU seconds /
cores: the kinds below say which work a faster suite has to remove. A process is sampled every
`--every` seconds, so processes shorter than that are missed (they cost little). Linux only."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HZ = os.sysconf("SC_CLK_TCK")
# (pattern on the command line, kind): the first that matches names the process
KINDS = [
    (r"VLLM::|vllm\.entrypoints", "vLLM server (API, engine core, worker)"),
    (r"-m weightsync serve", "reference engine (weightsync serve)"),
    (r"weightsync_reference\.forkserver", "reference engines forked by the suite's fork servers"),
    (r"-m weightsync demo", "RL demo (trainer side)"),
    (r"ray::|raylet|gcs_server|dashboard|ray/_private|ray/autoscaler", "Ray"),
    (r"weightsync-fresh-|-m build\b|hatchling|twine", "packaging tests: builds, fresh venvs"),
    (r"-m pip\b|__pip-runner__|bin/pip\b", "pip installs (make's setup, verl's venv)"),
    (r"mypy|ruff", "lint (mypy, ruff)"),
    (r"exec\(eval\(sys\.stdin|-m pytest|py\.test", "pytest (controller and workers)"),
    (r"multiprocessing\.spawn|torchrun|megatron", "spawned ranks (torch, Megatron)"),
    (r"python", "other Python processes"),
]


def kind_of(cmd: str) -> str:
    return next((k for pat, k in KINDS if re.search(pat, cmd)), "other")


def busy() -> tuple[int, int]:
    """(all jiffies, idle jiffies) of the machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


class Sampler(threading.Thread):
    """CPU seconds of every process seen while it runs (keyed by pid and start time, so a reused
    pid is a new process), less what each had used before the run began."""

    def __init__(self, every: float) -> None:
        super().__init__(daemon=True)
        self.every = every
        self.stop = threading.Event()
        self.procs: dict[str, list] = {}          # key -> [command, cpu at first sight, last cpu]
        self.first = True

    def scan(self) -> None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                fields = stat[stat.rfind(")") + 2:].split()
                cpu = (int(fields[11]) + int(fields[12])) / HZ
                key = f"{pid}:{fields[19]}"
                known = self.procs.get(key)
                # a spawned child names itself later (vLLM's "VLLM::EngineCore"): read it again
                if known is None or "multiprocessing" in known[0]:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    known = self.procs.setdefault(key, [cmd, cpu if self.first else 0.0, cpu])
                    known[0] = cmd
                known[2] = cpu
            except (OSError, IndexError, ValueError):
                continue                          # gone between listdir and read
        self.first = False

    def run(self) -> None:
        while not self.stop.is_set():
            self.scan()
            self.stop.wait(self.every)

    def by_kind(self) -> Counter:
        out: Counter = Counter()
        for key, (cmd, before, last) in self.procs.items():
            if not key.startswith(f"{os.getpid()}:"):          # not this sampler
                out[kind_of(cmd)] += last - before
        return out


def slowest_tests(log: str, top: int) -> list[tuple[str, float]]:
    """The longest test phases pytest listed (`--durations`), longest first."""
    found = re.findall(r"^\s*([\d.]+)s ((?:call|setup|teardown)\s+\S+)", log, re.M)
    rows = sorted(((re.sub(r"\s+", " ", what), float(s)) for s, what in found), key=lambda r: -r[1])
    return rows[:top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--log", type=Path, default=Path("suite-cpu.log"), help="the command's output")
    ap.add_argument("--procs", type=Path, help="also write every process: command, CPU-s")
    ap.add_argument("command", nargs="*", help="default: the suite on 2 xdist workers")
    args = ap.parse_args()
    cmd = args.command or [str(ROOT / ".venv/bin/python"), "-m", "pytest", "-n", "2",
                           "--dist", "loadscope", "--durations=0"]
    sampler = Sampler(args.every)
    sampler.start()
    all0, idle0 = busy()
    t0 = time.monotonic()
    with open(args.log, "w") as out:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    all1, idle1 = busy()
    sampler.stop.set()
    sampler.join()
    kinds = sampler.by_kind()
    total = sum(kinds.values())
    summary = {
        "command": cmd, "exit": rc, "wall_s": round(wall, 1), "cores": os.cpu_count(),
        "busy": round(1 - (idle1 - idle0) / max(all1 - all0, 1), 3),
        "cpu_s": round(total, 1), "processes": len(sampler.procs),
        "cpu_s_by_kind": {k: round(v, 1) for k, v in kinds.most_common()},
        "slowest_tests_s": slowest_tests(args.log.read_text(errors="replace"), 15),
    }
    print(f"exit {rc}, wall {wall:.0f} s, cores {os.cpu_count()} busy {summary['busy']:.0%}, "
          f"{total:.0f} CPU-s in {len(sampler.procs)} processes (log: {args.log})")
    for k, v in kinds.most_common():
        print(f"  {v:8.0f} CPU-s  {v / max(total, 1):4.0%}  {k}")
    for what, s in summary["slowest_tests_s"]:
        print(f"  {s:8.0f} s      {what}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    if args.procs:
        rows = sorted(((round(last - before, 2), cmd[:400]) for key, (cmd, before, last)
                       in sampler.procs.items()), reverse=True)
        args.procs.write_text(json.dumps(rows, indent=0) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
