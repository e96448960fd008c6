"""The `weightsync` command: plugins, serve, check, demo, bench."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _plugins(args: argparse.Namespace) -> int:
    from .plugins import describe_plugins, load_components
    rows = describe_plugins(load_components())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table
    table = Table("plugin", "distribution", "version", "components", "hooks")
    for r in rows:
        comps = ", ".join(r["components"]) or ("[red]failed: " + r["error"] + "[/red]" if r.get("error") else "-")
        table.add_row(r["name"], r["distribution"] or "-", r["version"] or "-", comps,
                      ", ".join(h.removeprefix("register_") for h in r["hooks"]))
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .server import serve
    serve(args.model, args.host, args.port, args.api_key, args.name, args.device)
    return 0


def _check(args: argparse.Namespace) -> int:
    from .config import SyncConfig, resolve
    from .errors import WeightSyncError
    from .plugins import load_components
    try:
        r = resolve(SyncConfig.load(args.config), load_components())
    except WeightSyncError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"ok: exporter {r.exporter_cls.name}, encoding {r.encoding_cls.name}, transport "
          f"{r.transport_cls.name}, engines {[p.spec.name for p in r.engines]}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(engine=args.engine, steps=args.steps, workdir=args.workdir)


def _bench(args: argparse.Namespace) -> int:
    try:
        from .bench import run_bench
    except ImportError as e:
        print(f"error: the benchmark is not available: {e}", file=sys.stderr)
        return 2
    return run_bench(args)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser("weightsync", description="Move trainer weights into inference engines.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("plugins", help="list installed plugins and their components")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=_plugins)
    sp = sub.add_parser("serve", help="run the reference engine")
    sp.add_argument("--model", required=True, help="HF model directory (or safetensors only)")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=8100)
    sp.add_argument("--api-key", default=None)
    sp.add_argument("--name", default=None)
    sp.add_argument("--device", default="cpu", help="where the weights live: cpu, cuda, cuda:N")
    sp.set_defaults(fn=_serve)
    sp = sub.add_parser("check", help="validate a sync config against the installed plugins")
    sp.add_argument("config")
    sp.set_defaults(fn=_check)
    sp = sub.add_parser("demo", help="train a tiny LM and push every step into a live engine")
    sp.add_argument("--engine", default="reference")
    sp.add_argument("--steps", type=int, default=5)
    sp.add_argument("--workdir", default=None)
    sp.set_defaults(fn=_demo)
    sp = sub.add_parser("bench", help="benchmark transports against baselines")
    sp.add_argument("--size", default="1GiB")
    sp.add_argument("--receivers", type=int, default=2)
    sp.add_argument("--transports", default=None, help="comma list; default all installed")
    sp.add_argument("--bucket", default="64MiB")
    sp.add_argument("--json", default=None, help="write results JSON here")
    sp.add_argument("--png", default=None, help="write a bar chart here (default: next to --json)")
    sp.add_argument("--repeat", type=int, default=1, help="timed runs per row after one warm-up")
    sp.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    sp.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="rows to run: cpu, cuda (GPU rows only), auto (cpu, plus GPU rows when "
                         "CUDA is available)")
    sp.set_defaults(fn=_bench)
    args = p.parse_args(argv)
    return args.fn(args)
