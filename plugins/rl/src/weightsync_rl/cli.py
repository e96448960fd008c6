"""`weightsync demo` and `weightsync route`: their arguments. The run itself (and everything
heavy) loads only when the command runs."""

from __future__ import annotations

import argparse

from weightsync.cli import UserError, key_args

__all__ = ["add_commands"]

_FMT = argparse.ArgumentDefaultsHelpFormatter


def _route(args: argparse.Namespace) -> int:
    from weightsync.net.keys import resolve_key
    from weightsync.plugins import load_components
    from weightsync_rl.rollout import RolloutClient, RolloutRouter
    components = load_components()
    if bool(args.fleet) == bool(args.engine):
        raise UserError("give the fleet registry (--fleet URL) or the engines (--engine URL ...)")
    if args.fleet:
        cls = components.fleets.get("registry")
        fleet = cls(cls.Options.model_validate({"url": args.fleet, "api_key": args.fleet_key,
                                                "trainer_key_file": args.fleet_trainer_key_file,
                                                "router_key_file": args.fleet_router_key_file}))
        fleet.open(components, None)
        client = RolloutClient(fleet=fleet, adapter=args.adapter, components=components,
                               stuck=args.stuck)
    else:
        client = RolloutClient([{"url": u, "adapter": args.adapter} for u in args.engine],
                               components=components, stuck=args.stuck)
    from weightsync.errors import ConfigError
    try:
        router = RolloutRouter(client, args.host, args.port,
                               api_key=resolve_key(args.api_key, args.api_key_file,
                                                   env="WEIGHTSYNC_ROUTER_KEY"),
                               insecure=args.insecure, max_tokens=args.max_tokens)
    except ConfigError as e:
        client.close()
        raise UserError(str(e)) from None
    print(f"weightsync router at {router.url} (POST /generate, GET /members)", flush=True)
    try:
        router.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        router.close()
    return 0


def _demo(args: argparse.Namespace) -> int:
    import os
    from weightsync.net.process import START_TIMEOUT_ENV
    from weightsync_rl.demo import run_demo
    if args.start_timeout is not None:
        os.environ[START_TIMEOUT_ENV] = str(args.start_timeout)
    return run_demo(engine=args.engine, steps=args.steps, workdir=args.workdir,
                    mode="async" if args.async_ else "sync", push=not args.no_push,
                    plot_path=args.plot, metrics_path=args.metrics, tensorboard=args.tensorboard,
                    wandb=args.wandb)


def add_commands(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("demo", help="a GRPO run whose rollouts come from live engines, pushing "
                        "every step", formatter_class=_FMT)
    sp.add_argument("--engine", default="reference", help="the adapter kind of the engines: the "
                    "built-in reference engine, or a plugin's engine that can start locally")
    sp.add_argument("--steps", type=int, default=40, help="GRPO steps, one push each")
    sp.add_argument("--async", dest="async_", action="store_true",
                    help="generate the next step's rollouts while this step trains and pushes "
                         "(one step off-policy)")
    sp.add_argument("--no-push", action="store_true", help="never push (the control run: the "
                    "engines keep the first weights and the reward must not rise)")
    sp.add_argument("--plot", default=None, help="where the PNG of the run goes "
                    "(default: ./weightsync-demo-ENGINE-MODE.png)")
    sp.add_argument("--metrics", default=None, metavar="FILE", help="each step's metrics as a "
                    "JSON line (default: the plot's path with .jsonl)")
    sp.add_argument("--tensorboard", default=None, metavar="DIR", help="also log each step to "
                    "TensorBoard in DIR (pip install 'weightsync-rl[tensorboard]')")
    sp.add_argument("--wandb", default=None, metavar="PROJECT", help="also log each step to this "
                    "Weights & Biases project (pip install 'weightsync-rl[wandb]')")
    sp.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, "
                    "removed after a run that passed, kept with the engines' logs otherwise)")
    sp.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                    help="how long an engine's start may take while its log grows (sets "
                    "$WEIGHTSYNC_START_TIMEOUT; default: the launcher's, 1200 s for vLLM; a "
                    "start whose log stays silent for $WEIGHTSYNC_START_STALL s fails sooner)")
    sp.set_defaults(fn=_demo)

    sp = sub.add_parser("route", help="serve generation for a whole fleet at one URL: requests "
                        "go to live members holding a fitting version", formatter_class=_FMT)
    sp.add_argument("--fleet", default=None, metavar="URL", help="a fleet registry to follow")
    sp.add_argument("--fleet-key", default=None, help="the registry's key (or $WEIGHTSYNC_FLEET_KEY)")
    sp.add_argument("--fleet-router-key-file", default=None, metavar="FILE",
                    help="the registry's router key (or $WEIGHTSYNC_FLEET_ROUTER_KEY): it reads "
                    "the members' rollout keys, which open generation only; it cannot read engine "
                    "keys or report a push")
    sp.add_argument("--fleet-trainer-key-file", default=None, metavar="FILE",
                    help="instead of the router key: the registry's trainer key (it reads the "
                    "members' engine keys and reports pushes: keep such a router where the "
                    "trainer is)")
    sp.add_argument("--engine", action="append", default=[], metavar="URL",
                    help="a static engine instead of a registry (repeat)")
    sp.add_argument("--adapter", default="reference", help="adapter kind of members that name none")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sp.add_argument("--port", type=int, default=8300, help="port to listen on")
    key_args(sp, "the router", "WEIGHTSYNC_ROUTER_KEY")
    sp.add_argument("--insecure", action="store_true", help="serve without a key (anyone who "
                    "reaches the router generates on the fleet)")
    sp.add_argument("--max-tokens", type=int, default=1 << 22, help="tokens one request may ask "
                    "for (prompts x n x max_new_tokens); larger ones are a 413")
    sp.add_argument("--stuck", type=float, default=10.0, help="seconds an engine holding a "
                    "prompt may answer nothing (not even /health) before the prompt moves to "
                    "another engine")
    sp.set_defaults(fn=_route)

