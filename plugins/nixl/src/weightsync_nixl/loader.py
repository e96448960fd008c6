"""NIXL, loaded on first use: a trainer or engine without it still imports this plugin, and the
first use says what to install. Also the one UCX default weightsync sets (see `load`)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from weightsync.errors import ConfigError

INSTALL = ("transport 'nixl' needs NIXL in this environment: install torch first, then "
           "`python -m pip install nixl==1.5.1` (pip would otherwise choose a CUDA torch "
           "for it); on every engine too")

_api: ModuleType | None = None


def load() -> ModuleType:
    """`nixl._api`, imported once. Before the import, UCX_MODULES defaults to "^efa": with
    Debian's ibverbs-providers installed (every RDMA host has it) a process that loaded NIXL
    otherwise segfaults at exit (two copies of libnl); a UCX_MODULES the user set is kept."""
    global _api
    if _api is None:
        os.environ.setdefault("UCX_MODULES", "^efa")
        try:
            _api = importlib.import_module("nixl._api")
        except ImportError as e:
            raise ConfigError(f"{INSTALL} ({type(e).__name__}: {e})") from None
    return _api


def available() -> bool:
    """Whether NIXL can be imported here (tests skip on False)."""
    try:
        load()
    except ConfigError:
        return False
    return True
