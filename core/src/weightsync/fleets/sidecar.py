"""`weightsync join` (registers an engine that cannot register itself) and `weightsync fleet serve`
(a registry on its own); both run until SIGTERM or SIGINT, then leave cleanly."""

from __future__ import annotations

import json
import logging
import signal
import threading
from typing import Any
from urllib.parse import urlparse

from weightsync.net.keys import resolve_key

log = logging.getLogger("weightsync.fleets")


def _until_signalled() -> None:
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.5):
        pass


def run_sidecar(args: Any) -> int:
    from weightsync.config import ComponentRef, EngineSpec, build_options
    from weightsync.plugins import load_components
    from weightsync.fleets.member import Membership, wait_healthy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        options = json.loads(args.options)
    except ValueError as e:
        raise ValueError(f"--options is not JSON: {e}") from None
    key = resolve_key(args.api_key, args.api_key_file, env="WEIGHTSYNC_ENGINE_KEY")
    u = urlparse(args.url)
    name = args.name or f"{u.hostname}:{u.port or 80}"
    ref = ComponentRef(kind=args.engine)
    cls = load_components().adapters.get(args.engine)      # an unknown engine fails here, clearly
    adapter = cls(build_options(cls, ref, "adapter", options),
                  EngineSpec(url=args.url, name=name, api_key=key))
    print(f"waiting for {args.engine} engine {name} at {args.url} ...", flush=True)
    wait_healthy(adapter.health, args.wait, f"engine {name} at {args.url}")
    member = Membership(args.fleet, resolve_key(args.fleet_key, None, env="WEIGHTSYNC_FLEET_KEY"),
                        {"name": name, "url": args.url, "adapter": {"kind": args.engine},
                         "options": options, "api_key": key,
                         "rollout_key": resolve_key(None, args.rollout_key_file,
                                                    env="WEIGHTSYNC_ROLLOUT_KEY")},
                        version=lambda: _version(adapter),
                        credential_file=args.fleet_credential_file)
    member.start()
    print(f"registered {name} with {args.fleet}; heartbeating (Ctrl-C or SIGTERM deregisters)",
          flush=True)
    try:
        _until_signalled()
    finally:
        member.stop()
        adapter.close()
    return 0


def _version(adapter: Any) -> int | None:
    try:
        return adapter.health().version
    except Exception:  # noqa: BLE001 - an engine that does not answer reports no version
        return None


def run_registry(args: Any) -> int:
    from weightsync.net.keys import warn_if_open
    from weightsync.plugins import load_components
    from weightsync.fleets.service import RegistryService

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from weightsync.fleets.registry import require_key
    key = resolve_key(args.api_key, args.api_key_file, env="WEIGHTSYNC_FLEET_KEY")
    require_key(key, args.insecure)
    trainer = resolve_key(None, args.trainer_key_file, env="WEIGHTSYNC_FLEET_TRAINER_KEY")
    if not trainer:
        print("note: no trainer key (--trainer-key-file or $WEIGHTSYNC_FLEET_TRAINER_KEY): "
              "no trainer can read the members' engine keys from this registry", flush=True)
    service = RegistryService(load_components(), lease=args.lease, api_key=key,
                              peer_join=not args.no_peer_join, trainer_key=trainer,
                              state_file=args.state_file,
                              router_key=resolve_key(None, args.router_key_file,
                                                     env="WEIGHTSYNC_FLEET_ROUTER_KEY"))
    warn_if_open(args.host, key, "the fleet registry")
    url = service.start(args.host, args.port)
    print(f"weightsync fleet registry serving on {url}", flush=True)
    try:
        _until_signalled()
    finally:
        service.close()
    return 0
