"""The plugin manager: built-ins and entry-point plugins go through the same hooks. Kept light (no
interface, no torch), so the `weightsync` command can ask plugins for subcommands before it
imports anything heavy."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys

import pluggy

from . import hookspecs
from .hookspecs import PROJECT

log = logging.getLogger("weightsync.plugins")

DEFAULT_PLUGINS = ("weightsync.builtin",)


def _env_list(name: str) -> set[str] | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return {v.strip() for v in value.split(",") if v.strip()}


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
        pm._plugin_distinfo.append((plugin, ep.dist))  # what pluggy's own loader records


def make_plugin_manager(*, load_entrypoints: bool = True) -> pluggy.PluginManager:
    """A fresh manager. `WEIGHTSYNC_PLUGINS=a,b` loads only those entry points ("" loads none);
    `WEIGHTSYNC_DISABLE_PLUGIN_AUTOLOAD` loads none; `WEIGHTSYNC_TRACE_PLUGINS` prints hook calls."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.failed_plugins = {}  # type: ignore[attr-defined]
    if load_entrypoints and os.environ.get("WEIGHTSYNC_DISABLE_PLUGIN_AUTOLOAD") is None:
        _load_entrypoints(pm, pm.failed_plugins, _env_list("WEIGHTSYNC_PLUGINS"))  # type: ignore[attr-defined]
    for modname in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(modname), name=modname)
    pm.check_pending()
    if os.environ.get("WEIGHTSYNC_TRACE_PLUGINS"):
        def before(hook_name, impls, kwargs):  # noqa: ANN001
            print(f"weightsync: {hook_name} -> {[i.plugin_name for i in impls]}", file=sys.stderr)

        def after(outcome, hook_name, impls, kwargs):  # noqa: ANN001
            pass
        pm.add_hookcall_monitoring(before, after)
    return pm
