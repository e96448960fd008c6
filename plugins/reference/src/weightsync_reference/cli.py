"""`weightsync serve`: its arguments. The engine (and everything heavy) loads only when the
command runs."""

from __future__ import annotations

import argparse

from weightsync.cli import UserError, key_args

__all__ = ["add_command"]

_FMT = argparse.ArgumentDefaultsHelpFormatter


def _serve(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path
    # OpenMP threads that wait passively: engine processes often share a host's cores (several
    # per host, relays staging beside generation), and torch's default busy-wait after every
    # parallel op burned several times a delta's decode in CPU there. Read when torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not Path(args.model).is_dir():
        raise UserError(f"model directory {args.model} does not exist (give --model the "
                        f"directory with config.json and *.safetensors)")
    from weightsync_reference.server import serve
    serve(args.model, args.host, args.port, args.api_key, args.name, args.device,
          api_key_file=args.api_key_file, load_roots=args.load_root, fleet=args.fleet,
          fleet_key=args.fleet_key, fleet_credential_file=args.fleet_credential_file,
          advertise=args.advertise, verbosity=args.verbose - args.quiet,
          hmac_key_file=args.hmac_key_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
          rollout_key_file=args.rollout_key_file, share_source=args.share_source)
    return 0


def add_command(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("serve", help="run the reference engine", formatter_class=_FMT)
    sp.add_argument("--model", required=True, help="HF model directory (or safetensors only)")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sp.add_argument("--port", type=int, default=8100, help="port to listen on (0: any free port)")
    key_args(sp, "the engine", "WEIGHTSYNC_API_KEY")
    sp.add_argument("--rollout-key-file", default=None, metavar="FILE",
                    help="a second key (or $WEIGHTSYNC_ROLLOUT_KEY) that opens /generate and "
                    "/info only, never a weight route: a rollout router's, which the fleet "
                    "registry hands to the router key")
    sp.add_argument("--name", default=None, help="engine name in reports (default host:port)")
    sp.add_argument("--device", default="cpu", help="where the weights live: cpu, cuda, cuda:N")
    sp.add_argument("--load-root", action="append", default=[], metavar="DIR",
                    help="a directory load_from_disk may read below (repeatable; none: refused)")
    sp.add_argument("--fleet", default=None, metavar="URL", help="register with this fleet registry")
    sp.add_argument("--fleet-key", default=None, help="the registry's API key (or $WEIGHTSYNC_FLEET_KEY)")
    sp.add_argument("--fleet-credential-file", default=None, metavar="FILE",
                    help="keep this member's credential here, so a restarted engine takes its "
                    "fleet name back at once (without it: after the registry releases the name)")
    sp.add_argument("--advertise", default=None, metavar="URL",
                    help="the URL the registry and trainer reach this engine at (default from --host/--port)")
    sp.add_argument("--share-source", default="http", metavar="NAME",
                    help="the peer source whose serving half serves joiners this engine's weights "
                         "(http: this server's own routes; a plugin's source, e.g. nixl: "
                         "registered memory a joiner reads one-sided)")
    sp.add_argument("--hmac-key-file", default=None, help="refuse payloads not signed with this "
                    "shared key (also $WEIGHTSYNC_HMAC_KEY)")
    sp.add_argument("--tls-cert", default=None, help="serve HTTPS with this certificate (PEM)")
    sp.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    sp.add_argument("-v", "--verbose", action="count", default=0, help="more log lines (-v: debug)")
    sp.add_argument("-q", "--quiet", action="count", default=0, help="warnings only")
    sp.set_defaults(fn=_serve)

