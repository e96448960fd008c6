"""Where a vLLM worker offers the pieces it checked to the engines it feeds (the `http`
transport's fetch relays, `shape: chain | tree`): a small body server in the worker of rank 0,
configured from the server's environment.

  WEIGHTSYNC_VLLM_RELAY=host[:port]      bind address (default 127.0.0.1:0, a free loopback
                                         port: engines on this host feed each other); "off":
                                         this engine takes its own copy from the trainer
  WEIGHTSYNC_VLLM_RELAY_ADVERTISE=addr   the address other engines reach it at (default: host)

What it serves is only ever fetched with an id and token the trainer chose for one bucket and
gave the fetching engine over that engine's own authenticated channel, and every engine checks
each piece against the trainer's digests, so a relay can delay a bucket but not change it."""

from __future__ import annotations

import logging
import os

from weightsync.net.bodyserver import BodyServer

RELAY_ENV = "WEIGHTSYNC_VLLM_RELAY"
ADVERTISE_ENV = "WEIGHTSYNC_VLLM_RELAY_ADVERTISE"
LINGER = 30.0            # seconds a child's fetch waits for its parent to be told what to offer

log = logging.getLogger("weightsync.vllm")


def relay_server(rank: int, timeout: float = 300.0) -> BodyServer | None:
    """The worker's relay body server, started (rank 0 only; None where relaying is off)."""
    spec = os.environ.get(RELAY_ENV, "127.0.0.1:0").strip()
    if rank != 0 or spec.lower() in ("off", "0", "no", "false", ""):
        return None
    host, _, port = spec.rpartition(":") if ":" in spec else (spec, "", "0")
    try:
        server = BodyServer(host or "127.0.0.1", int(port or 0),
                            advertise=os.environ.get(ADVERTISE_ENV) or None, timeout=timeout,
                            max_connections=64, linger=LINGER)
        server.start()
    except (OSError, ValueError) as e:
        log.warning("weightsync backend: no relay body server on %r (%s): this engine takes "
                    "its own copy from the trainer (set $%s to host:port, or 'off')", spec, e,
                    RELAY_ENV)
        return None
    log.info("weightsync backend: relay body server at %s", server.url)
    return server
