"""The components: the registries filled by calling the registration hooks once, and what
`weightsync plugins` prints. The manager itself is `pluginmanager` (re-exported here)."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import pluggy

from .interfaces import Adapter, Encoding, Exporter, Fleet, PeerSource, Transport
from .errors import PluginError
from .pluginmanager import DEFAULT_PLUGINS, make_plugin_manager
from .registry import Registry

log = logging.getLogger(__name__)


@dataclass
class Components:
    """The registries, filled once by calling the registration hooks."""

    pm: pluggy.PluginManager
    failed: dict[str, str]
    exporters: Registry[Exporter] = field(init=False)
    encodings: Registry[Encoding] = field(init=False)
    transports: Registry[Transport] = field(init=False)
    adapters: Registry[Adapter] = field(init=False)
    fleets: Registry[Fleet] = field(init=False)
    peer_sources: Registry[PeerSource] = field(init=False)

    def __post_init__(self) -> None:
        self.exporters = Registry("exporter", Exporter, self.failed)
        self.encodings = Registry("encoding", Encoding, self.failed)
        self.transports = Registry("transport", Transport, self.failed)
        self.adapters = Registry("adapter", Adapter, self.failed)
        self.fleets = Registry("fleet", Fleet, self.failed)
        self.peer_sources = Registry("peer source", PeerSource, self.failed)
        for hook, registry in (("register_exporters", self.exporters),
                               ("register_encodings", self.encodings),
                               ("register_transports", self.transports),
                               ("register_adapters", self.adapters),
                               ("register_fleets", self.fleets),
                               ("register_peer_sources", self.peer_sources)):
            self._call(hook, registry)

    def _call(self, hook: str, registry: Registry[Any]) -> None:
        """Each plugin's hook separately: one that raises is recorded as failed (a warning) and
        the others still register; a duplicate name stays an error."""
        impls = list(reversed(getattr(self.pm.hook, hook).get_hookimpls()))
        if os.environ.get("WEIGHTSYNC_TRACE_PLUGINS"):
            # called one by one below, which pluggy's hookcall monitoring never sees: trace here
            print(f"weightsync: {hook} -> {[i.plugin_name for i in impls]}", file=sys.stderr)
        for impl in impls:
            try:
                impl.function(register=registry.add)
            except PluginError:
                raise
            except Exception as err:
                log.warning("weightsync plugin %r failed in %s: %r", impl.plugin_name, hook, err)
                self.failed[impl.plugin_name] = f"{hook}: {err!r}"

    def registry(self, kind: str) -> Registry[Any]:
        return {"exporter": self.exporters, "encoding": self.encodings,
                "transport": self.transports, "adapter": self.adapters, "fleet": self.fleets,
                "peer_source": self.peer_sources}[kind]


def load_components(pm: pluggy.PluginManager | None = None) -> Components:
    pm = pm or make_plugin_manager()
    return Components(pm, getattr(pm, "failed_plugins", {}))


def describe_plugins(components: Components) -> list[dict[str, Any]]:
    """What `weightsync plugins` prints: each plugin, its distribution, hooks and components."""
    dists = {id(p): d for p, d in components.pm.list_plugin_distributions()}
    by_module: dict[str, list[str]] = {}
    for kind in ("exporter", "encoding", "transport", "adapter", "fleet", "peer_source"):
        for name, cls in components.registry(kind).items():
            by_module.setdefault(cls.__module__.split(".")[0], []).append(f"{kind}:{name}")
    out = []
    for name, plugin in components.pm.list_name_plugin():
        dist = dists.get(id(plugin))
        top = getattr(plugin, "__name__", "").split(".")[0]
        if name in DEFAULT_PLUGINS:
            dist_name, version = "weightsync-core", _version("weightsync-core")
            comps = by_module.get("weightsync", [])
        else:
            dist_name = dist.metadata["name"] if dist else None
            version = dist.version if dist else None
            comps = by_module.get(top, [])
        hooks = sorted(h.name for h in components.pm.get_hookcallers(plugin) or [])
        out.append({"name": name, "distribution": dist_name, "version": version,
                    "hooks": hooks, "components": sorted(comps)})
    for name, err in sorted(components.failed.items()):
        out.append({"name": name, "distribution": None, "version": None, "hooks": [],
                    "components": [], "error": err})
    return out


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
