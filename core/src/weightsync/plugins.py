"""The plugin system: the manager (built-ins and entry-point plugins go through the same hooks),
the registries filled by the registration hooks, and what `weightsync plugins` prints. Importing
it is light (no torch), so the `weightsync` command asks plugins for subcommands at once."""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import pluggy

from weightsync import hookspecs
from weightsync.errors import PluginError
from weightsync.hookspecs import PROJECT

if TYPE_CHECKING:
    from weightsync.interfaces import (Adapter, Encoding, Exporter, Fleet, Launcher, PeerSource,
                                       Transport)

__all__ = ["DEFAULT_PLUGINS", "Components", "Registry", "describe_plugins", "load_components",
           "make_plugin_manager"]

log = logging.getLogger("weightsync.plugins")

DEFAULT_PLUGINS = ("weightsync.builtin",)
KINDS = ("exporter", "encoding", "transport", "adapter", "fleet", "peer_source", "launcher")


def _env_list(name: str) -> set[str] | None:
    value = os.environ.get(name)
    return None if value is None else {v.strip() for v in value.split(",") if v.strip()}


def _load_entrypoints(pm: pluggy.PluginManager, failed: dict[str, str], only: set[str] | None) -> None:
    for ep in importlib.metadata.entry_points(group=PROJECT):
        if only is not None and ep.name not in only:
            continue
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as err:  # a broken plugin must not take the whole sync down
            log.warning("weightsync plugin %r failed to import: %r", ep.name, err)
            failed[ep.name] = repr(err)
            continue
        pm.register(plugin, name=ep.name)
        if ep.dist is not None:         # always set on what entry_points() returns
            pm._plugin_distinfo.append((plugin, ep.dist))  # what pluggy's own loader records


def _load_modules(pm: pluggy.PluginManager, failed: dict[str, str], names: set[str]) -> None:
    """Plugins named by module, not installed (a plugin under test, in an engine's process)."""
    for modname in sorted(names):
        if pm.get_plugin(modname) is not None:
            continue
        try:
            pm.register(importlib.import_module(modname), name=modname)
        except Exception as err:  # a broken plugin must not take the whole sync down
            log.warning("weightsync plugin module %r failed to import: %r", modname, err)
            failed[modname] = repr(err)


def make_plugin_manager(*, load_entrypoints: bool = True) -> pluggy.PluginManager:
    """A fresh manager. `WEIGHTSYNC_PLUGINS=a,b` loads only those entry points ("" loads none);
    `WEIGHTSYNC_DISABLE_PLUGIN_AUTOLOAD` loads none; `WEIGHTSYNC_PLUGIN_MODULES=pkg.plugin,...`
    also registers those modules (importable, not installed); `WEIGHTSYNC_TRACE_PLUGINS` prints
    hook calls."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.failed_plugins = {}  # type: ignore[attr-defined]
    if load_entrypoints and os.environ.get("WEIGHTSYNC_DISABLE_PLUGIN_AUTOLOAD") is None:
        _load_entrypoints(pm, pm.failed_plugins, _env_list("WEIGHTSYNC_PLUGINS"))  # type: ignore[attr-defined]
    _load_modules(pm, pm.failed_plugins, _env_list("WEIGHTSYNC_PLUGIN_MODULES") or set())  # type: ignore[attr-defined]
    for modname in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(modname), name=modname)
    for impl in pm.hook.add_hookspecs.get_hookimpls():  # applications' own hooks, before the check
        try:
            impl.function(pluginmanager=pm)
        except Exception as err:  # a broken application must not take the others down
            log.warning("weightsync plugin %r failed in add_hookspecs: %r", impl.plugin_name, err)
            pm.failed_plugins[impl.plugin_name] = f"add_hookspecs: {err!r}"  # type: ignore[attr-defined]
            pm.unregister(name=impl.plugin_name)
    pm.check_pending()
    if os.environ.get("WEIGHTSYNC_TRACE_PLUGINS"):
        def before(hook_name, impls, kwargs):  # noqa: ANN001
            print(f"weightsync: {hook_name} -> {[i.plugin_name for i in impls]}", file=sys.stderr)
        pm.add_hookcall_monitoring(before, lambda *_: None)
    return pm


C = TypeVar("C")


class Registry(Generic[C]):
    # `base` is typed `type`, not `type[C]`: the bases are abstract classes
    def __init__(self, kind: str, base: type, failed: dict[str, str] | None = None) -> None:
        self.kind, self.base = kind, base
        self._classes: dict[str, type[C]] = {}
        self.failed = failed if failed is not None else {}

    def add(self, cls: type[C]) -> None:
        """The `register` callback handed to plugins."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise PluginError(f"{cls!r} is not a {self.base.__name__}; register a subclass of "
                              f"weightsync.{self.base.__name__}")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"{cls.__module__}.{cls.__qualname__} has no `name` class attribute")
        other = self._classes.setdefault(name, cls)
        if other is not cls:
            raise PluginError(f"{self.kind} {name!r} is registered by both "
                              f"{other.__module__}.{other.__qualname__} and "
                              f"{cls.__module__}.{cls.__qualname__}; uninstall one of them or "
                              f"limit loading with WEIGHTSYNC_PLUGINS")

    def get(self, name: str) -> type[C]:
        try:
            return self._classes[name]
        except KeyError:
            near = difflib.get_close_matches(str(name), list(self._classes), n=3, cutoff=0.6)
            msg = (f"unknown {self.kind} {name!r}"
                   + (f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else "")
                   + f"; installed: {sorted(self._classes)}")
            if self.failed:
                msg += "; plugins that failed to import: " + ", ".join(
                    f"{k} ({v})" for k, v in sorted(self.failed.items()))
            raise PluginError(msg) from None

    def names(self) -> list[str]:
        return sorted(self._classes)

    def items(self) -> list[tuple[str, type[C]]]:
        return sorted(self._classes.items())

    def __contains__(self, name: object) -> bool:
        return name in self._classes


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
    launchers: Registry[Launcher] = field(init=False)

    def __post_init__(self) -> None:
        from weightsync.interfaces import (Adapter, Encoding, Exporter, Fleet, Launcher,
                                           PeerSource, Transport)
        for kind, base in zip(KINDS, (Exporter, Encoding, Transport, Adapter, Fleet, PeerSource,
                                      Launcher)):
            setattr(self, f"{kind}s", Registry(kind.replace("_", " "), base, self.failed))
        for kind in KINDS:
            self._call(f"register_{kind}s", self.registry(kind))

    def _call(self, hook: str, registry: Registry[Any]) -> None:
        """Each plugin's hook separately: one that raises is recorded as failed, the rest go on."""
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
        return {k: getattr(self, f"{k}s") for k in KINDS}[kind]


def load_components(pm: pluggy.PluginManager | None = None) -> Components:
    pm = pm or make_plugin_manager()
    return Components(pm, getattr(pm, "failed_plugins", {}))


def describe_plugins(components: Components) -> list[dict[str, Any]]:
    """What `weightsync plugins` prints: each plugin, its distribution, hooks and components."""
    dists = {id(p): d for p, d in components.pm.list_plugin_distributions()}
    by_module: dict[str, list[str]] = {}
    for kind in KINDS:
        for name, cls in components.registry(kind).items():
            by_module.setdefault(cls.__module__.split(".")[0], []).append(f"{kind}:{name}")
    out = []
    for name, plugin in components.pm.list_name_plugin():
        dist = dists.get(id(plugin))
        dist_name: str | None
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
