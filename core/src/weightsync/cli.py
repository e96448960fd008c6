"""The `weightsync` command. Nothing heavy is imported before a subcommand runs, so `--help` and
`--version` answer at once; a user error is one line on stderr (exit status 2), not a traceback."""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import sys
from typing import Any, Sequence, cast

__all__ = ["UserError", "key_args", "main", "parser"]

_FMT = argparse.ArgumentDefaultsHelpFormatter


def _versions() -> str:
    from importlib.metadata import distributions
    seen = {}
    for d in distributions():
        # an email Message: typeshed's PackageMetadata declares .get only from Python 3.12
        name = (cast(Any, d.metadata).get("Name") or "").lower().replace("_", "-")
        if name.startswith("weightsync-"):
            seen[name] = d.version
    core = seen.pop("weightsync-core", "not installed")
    return "\n".join([f"weightsync-core {core}"] + [f"{n} {v}" for n, v in sorted(seen.items())])


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print every installed weightsync "
                                                             "distribution's version and exit")

    def __call__(self, *args: Any, **kw: Any) -> None:
        print(_versions())
        raise SystemExit(0)


# -- subcommands ------------------------------------------------------------------------------
def _plugins(args: argparse.Namespace) -> int:
    from weightsync.plugins import describe_plugins, load_components
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


def _check(args: argparse.Namespace) -> int:
    from weightsync.config import SyncConfig
    from weightsync.sync.check import check_config, contact
    problems, summary = check_config(args.config)
    lines: list[str] = []
    if not problems and not args.offline:
        from weightsync.sync.pipeline import WeightSync
        with WeightSync.from_config(SyncConfig.load(args.config)) as sync:
            problems, lines = contact(sync)
    for line in lines:
        print(f"  {line}")
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2
    print(f"ok: {summary}" + ("" if args.offline else f"; {len(lines)} engines answered"))
    return 0


def _lazy(module: str, name: str) -> Any:
    """A subcommand whose module is imported only when it runs."""
    return lambda args: getattr(importlib.import_module(module), name)(args)


def _fleet_ls(args: argparse.Namespace) -> int:
    from weightsync.fleets.client import RegistryClient
    from weightsync.net.keys import resolve_key
    view = RegistryClient(args.registry, resolve_key(args.api_key, args.api_key_file,
                                                     env="WEIGHTSYNC_FLEET_KEY")).fleet()
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    print(f"fleet version {view['version']}, lease {view['lease']}s, {len(view['members'])} members")
    print(f"{'name':<24} {'adapter':<10} {'role':<6} {'version':>7} {'state':<8} {'lease':>6}  url")
    for m in view["members"]:
        print(f"{m['name']:<24} {m['adapter']:<10} {m['role']:<6} {str(m['version']):>7} "
              f"{m['state']:<8} {m['lease_left']:>6.1f}  {m['url']}"
              + (f"  ({m['error']})" if m.get("error") else ""))
    return 0


# -- the parser -------------------------------------------------------------------------------
def key_args(sp: argparse.ArgumentParser, what: str, env: str) -> None:
    """`--api-key` and `--api-key-file` for a service, the same in every command."""
    sp.add_argument("--api-key", default=None, help=f"{what}'s API key (prefer --api-key-file or ${env})")
    sp.add_argument("--api-key-file", default=None, help=f"read {what}'s API key from this file")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("weightsync", description="Move trainer weights into inference "
                                "engines: fast, verified, versioned.", formatter_class=_FMT)
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    sp = sub.add_parser("plugins", help="list installed plugins and their components", formatter_class=_FMT)
    sp.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sp.set_defaults(fn=_plugins)

    sp = sub.add_parser("check", help="validate a sync config against the installed plugins "
                        "(every problem at once)", formatter_class=_FMT)
    sp.add_argument("config", help="a .yaml, .yml, .toml or .json sync config")
    sp.add_argument("--offline", action="store_true", help="check the config alone; by default "
                    "every engine of the fleet is asked for its health, version and access")
    sp.set_defaults(fn=_check)

    sp = sub.add_parser("join", formatter_class=_FMT, help="register an engine that cannot "
                        "register itself with a fleet registry, heartbeat, deregister on exit")
    sp.add_argument("--fleet", required=True, metavar="URL", help="the fleet registry")
    sp.add_argument("--fleet-key", default=None, help="the registry's API key (or $WEIGHTSYNC_FLEET_KEY)")
    sp.add_argument("--fleet-credential-file", default=None, metavar="FILE", help="keep this "
                    "member's credential here, so a restarted sidecar takes its name back at once")
    sp.add_argument("--engine", required=True, help="the engine's adapter kind (`weightsync plugins` "
                    "lists them)")
    sp.add_argument("--url", required=True, help="the engine's URL")
    key_args(sp, "the engine", "WEIGHTSYNC_ENGINE_KEY")
    sp.add_argument("--name", default=None, help="member name (default: the URL's host:port)")
    sp.add_argument("--options", default="{}", help="adapter options as JSON")
    sp.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the engine's health")
    sp.add_argument("--rollout-key-file", default=None, metavar="FILE",
                    help="a key of the engine that opens generation and no weight route (or "
                    "$WEIGHTSYNC_ROLLOUT_KEY): what the registry gives a rollout router")
    sp.set_defaults(fn=_lazy("weightsync.fleets.sidecar", "run_sidecar"))

    fp = sub.add_parser("fleet", help="the fleet registry: serve it, list its members",
                        formatter_class=_FMT)
    fsub = fp.add_subparsers(dest="fleet_cmd", required=True, metavar="COMMAND")
    sp = fsub.add_parser("serve", help="run a fleet registry on its own", formatter_class=_FMT)
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sp.add_argument("--port", type=int, default=8200, help="port to listen on")
    key_args(sp, "the registry", "WEIGHTSYNC_FLEET_KEY")
    sp.add_argument("--trainer-key-file", default=None,
                    help="the trainer's key (or $WEIGHTSYNC_FLEET_TRAINER_KEY): only it reads the "
                         "members' engine keys and reports pushes")
    sp.add_argument("--router-key-file", default=None,
                    help="the rollout router's key (or $WEIGHTSYNC_FLEET_ROUTER_KEY): it reads "
                         "the members' rollout keys (generation only) and nothing else")
    sp.add_argument("--state-file", default=None, help="keep the fleet's version, digests and name "
                    "bindings in this file across restarts")
    sp.add_argument("--insecure", action="store_true",
                    help="serve without a fleet key (anyone who reaches it can join)")
    sp.add_argument("--lease", type=float, default=10.0, help="seconds a member stays without a heartbeat")
    sp.add_argument("--no-peer-join", action="store_true", help="members behind wait for the next push")
    sp.set_defaults(fn=_lazy("weightsync.fleets.sidecar", "run_registry"))
    sp = fsub.add_parser("ls", help="list a registry's members", formatter_class=_FMT)
    sp.add_argument("--registry", required=True, metavar="URL", help="the fleet registry")
    key_args(sp, "the registry", "WEIGHTSYNC_FLEET_KEY")
    sp.add_argument("--json", action="store_true", help="print JSON (what GET /fleet answers)")
    sp.set_defaults(fn=_fleet_ls)
    _plugin_commands(sub)
    return p


class UserError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


def _plugin_commands(sub: argparse._SubParsersAction) -> None:
    """Subcommands from plugins (`register_commands`); a plugin whose hook fails is skipped."""
    import logging

    from weightsync.plugins import make_plugin_manager
    log = logging.getLogger("weightsync.plugins")
    try:
        pm = make_plugin_manager()
    except Exception as e:  # noqa: BLE001 - the built-in commands must still run
        log.warning("weightsync: plugins were not loaded for their commands: %r", e)
        return
    for impl in reversed(pm.hook.register_commands.get_hookimpls()):
        try:
            impl.function(subparsers=sub)
        except Exception as e:  # noqa: BLE001 - one plugin must not take the command down
            log.warning("weightsync plugin %r failed in register_commands: %r", impl.plugin_name, e)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - weightsync's own errors are user-facing sentences
        from weightsync.errors import WeightSyncError
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            print(f"error: port {getattr(args, 'port', '?')} is already in use; pick another with "
                  f"--port (0: any free port)", file=sys.stderr)
            return 2
        if not isinstance(e, (UserError, WeightSyncError, FileNotFoundError, NotADirectoryError,
                              PermissionError)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
