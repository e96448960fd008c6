"""API keys of weightsync's services: where they come from (argument, file, environment) and a
loud warning for a service that listens beyond loopback without one."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from pathlib import Path

__all__ = ["is_loopback", "resolve_key", "warn_if_open"]

log = logging.getLogger("weightsync.http")


def resolve_key(key: str | None = None, key_file: str | None = None,
                env: str = "WEIGHTSYNC_API_KEY") -> str | None:
    """The API key from (in order) the argument, a file, or the environment variable."""
    if key:
        return key
    if key_file:
        text = Path(key_file).read_text().strip()
        if not text:
            raise ValueError(f"API key file {key_file} is empty")
        return text
    return os.environ.get(env) or None


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def warn_if_open(host: str, key: str | None, what: str) -> None:
    if not key and not is_loopback(host):
        msg = (f"WARNING: {what} listens on {host} without an API key: anyone who can reach this "
               f"address can change its weights. Set --api-key-file or WEIGHTSYNC_API_KEY, or bind "
               f"to 127.0.0.1.")
        log.warning(msg)
        print(msg, flush=True)
