"""`weightsync-disk-delta agent ...` (also `weightsync disk-delta agent ...`, through the
`register_commands` hook): the pull agent of a rollout host, as a command."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence


def _adapter(kind: str, url: str | None, api_key: str | None):  # noqa: ANN202
    if kind == "none":
        return None
    if not url:
        raise SystemExit("error: --url is required unless --engine none")
    from weightsync.config import ComponentRef, EngineSpec, build_options
    from weightsync.interfaces import ReloadsFromDisk
    from weightsync.plugins import load_components
    cls = load_components().adapters.get(kind)
    if not issubclass(cls, ReloadsFromDisk):
        raise SystemExit(f"error: adapter {kind!r} cannot reload from disk (it has no "
                         f"`load_from_disk`: the ReloadsFromDisk capability)")
    return cls(build_options(cls, ComponentRef(kind=kind), "adapter"), EngineSpec(url=url, api_key=api_key))


def _fleet_version(member: Any) -> int | None:
    """The version the fleet registry reports (None when it cannot be asked right now)."""
    from weightsync.fleets.client import RegistryError
    try:
        v = member.client.fleet().get("version")
    except RegistryError:
        return None
    return v if isinstance(v, int) else None


def _agent(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    from weightsync.errors import WeightSyncError

    from .agent import Agent
    from .layout import load_hook
    from weightsync.net.keys import resolve_key
    adapter = _adapter(args.engine, args.url, resolve_key(args.api_key, args.api_key_file,
                                                          env="WEIGHTSYNC_ENGINE_KEY"))
    from weightsync.wire.signing import load_key
    agent = Agent(args.root, args.local, adapter, before_read=load_hook(args.before_read),
                  fsync=args.fsync, on_event=lambda m: print(f"agent: {m}", flush=True),
                  max_backoff=args.max_backoff, hmac_key=load_key(None, args.hmac_key_file))
    member = None
    if args.fleet:                          # show this host and its version in the fleet
        import socket

        from weightsync.fleets.member import Membership
        from weightsync.net.keys import resolve_key
        url = args.url or "http://127.0.0.1:1"
        member = Membership(args.fleet, resolve_key(args.fleet_key, None, env="WEIGHTSYNC_FLEET_KEY"),
                            {"name": args.name or socket.gethostname(), "url": url,
                             "adapter": {"kind": args.engine}, "role": "host"},
                            version=lambda: agent.local.version)
        member.start()
        agent.floor = lambda: _fleet_version(member)
    print(f"agent: following {args.root} into {args.local}", flush=True)
    try:
        v = agent.run(interval=args.interval, until=args.until, once=args.once, timeout=args.timeout)
    except (WeightSyncError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - --once: a bug is reported, with its traceback
        logging.getLogger("weightsync.disk_delta").exception("unexpected error")
        print(f"error: unexpected {type(e).__name__}: {e}; please report it with this output",
              file=sys.stderr, flush=True)
        return 1
    finally:
        if member is not None:
            member.stop()
    print(f"agent: done at version {v}", flush=True)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """The plugin's subcommands (`agent`) on `sub`, for either command."""
    sp = sub.add_parser("agent", help="follow a published root and keep an engine current",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sp.add_argument("--root", required=True, help="the published directory (shared filesystem)")
    sp.add_argument("--local", required=True, help="host-local checkpoint directory")
    sp.add_argument("--engine", default="reference",
                    help="adapter kind (reference, vllm, sglang, ...) or 'none' for only the checkpoint")
    sp.add_argument("--url", default=None, help="the engine's URL")
    sp.add_argument("--api-key", default=None, help="the engine's key (prefer --api-key-file or "
                    "$WEIGHTSYNC_ENGINE_KEY: a command line is visible to other users)")
    sp.add_argument("--api-key-file", default=None, help="read the engine's key from this file")
    sp.add_argument("--interval", type=float, default=0.5, help="seconds between polls of `latest`")
    sp.add_argument("--max-backoff", type=float, default=60.0,
                    help="longest wait after failed rounds (the wait doubles from --interval)")
    sp.add_argument("--once", action="store_true", help="one round, then exit")
    sp.add_argument("--until", type=int, default=None, help="exit once the engine is at this version")
    sp.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    sp.add_argument("--before-read", default=None, help="'module:function' called before each read")
    sp.add_argument("--fsync", action="store_true", help="flush the local checkpoint on every change")
    sp.add_argument("--hmac-key-file", default=None, help="refuse versions whose manifest is not "
                    "signed with this shared key (also $WEIGHTSYNC_HMAC_KEY)")
    sp.add_argument("--fleet", default=None, metavar="URL",
                    help="register this host (role host) with a fleet registry, with its version")
    sp.add_argument("--fleet-key", default=None, help="the registry's key (or $WEIGHTSYNC_FLEET_KEY)")
    sp.add_argument("--name", default=None, help="this host's member name (default: the hostname)")
    sp.set_defaults(fn=_agent)


def register_commands(subparsers: argparse._SubParsersAction) -> None:
    """`weightsync disk-delta ...`: the plugin's subcommands under the `weightsync` command."""
    p = subparsers.add_parser("disk-delta", help="the disk_delta plugin: pull published versions "
                              "into a host-local checkpoint (weightsync-disk-delta)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_commands(p.add_subparsers(dest="disk_delta_cmd", required=True, metavar="COMMAND"))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser("weightsync-disk-delta",
                                description="Pull published weight versions into a host-local checkpoint.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_commands(p.add_subparsers(dest="cmd", required=True))
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
