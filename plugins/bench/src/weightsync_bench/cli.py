"""`weightsync bench`: its arguments. The run itself (and everything heavy) loads only when the
command runs."""

from __future__ import annotations

import argparse

__all__ = ["add_command"]


def _bench(args: argparse.Namespace) -> int:
    from weightsync_bench.harness import run_bench
    return run_bench(args)


def add_command(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("bench", help="benchmark transports against baselines and floors",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sp.add_argument("--size", default="1GiB", help="model size")
    sp.add_argument("--receivers", type=int, default=2, help="engine processes")
    sp.add_argument("--transports", default=None, help="comma list (default: all installed)")
    sp.add_argument("--bucket", default="64MiB", help="bucket size")
    sp.add_argument("--json", default=None, help="write results JSON here")
    sp.add_argument("--png", default=None, help="write a bar chart here (default: next to --json)")
    sp.add_argument("--repeat", type=int, default=1, help="timed runs per row after one warm-up")
    sp.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    sp.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="rows to run: cpu, cuda (GPU rows only), auto (cpu, plus GPU rows when "
                         "CUDA is available)")
    sp.set_defaults(fn=_bench)
