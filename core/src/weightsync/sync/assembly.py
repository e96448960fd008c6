"""Assembly: from a validated `SyncConfig` to the classes and options of every component
(`resolve`, `plan_engine`), refusing combinations that cannot work (the `check_*` rules). Kept
apart from config.py, which holds only what users write and names no interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightsync.config import LOCAL_HOSTS, ComponentRef, EngineSpec, SyncConfig, build_options
from weightsync.errors import ConfigError
from weightsync.interfaces import Adapter, Encoding, Exporter, SharesRounds, Transport

__all__ = ["EnginePlan", "ResolvedConfig", "check_combination", "check_fleet_engines",
           "check_pause_mode", "check_senders", "missing", "plan_engine", "resolve"]


@dataclass
class EnginePlan:
    spec: EngineSpec
    adapter_cls: type[Adapter]
    adapter_options: Any


def plan_engine(spec: EngineSpec, default: ComponentRef, transport: type[Transport],
                encoding: type[Encoding], components: Any) -> "EnginePlan":
    """The adapter class and options for one engine, checked against the transport and encoding."""
    ref = spec.adapter or default
    ad = components.adapters.get(ref.kind)
    opts = build_options(ad, ref, "adapter", spec.options)
    check_combination(ad, opts, transport, encoding, spec, components)
    return EnginePlan(spec, ad, opts)


@dataclass
class ResolvedConfig:
    """Classes and validated options for every component; built once, before any sync."""

    config: SyncConfig
    exporter_cls: type[Exporter]
    exporter_options: Any
    encoding_cls: type[Encoding]
    encoding_options: Any
    transport_cls: type[Transport]
    transport_options: Any
    engines: list[EnginePlan]
    fleet_cls: Any = None
    fleet_options: Any = None


def resolve(config: SyncConfig, components: Any) -> ResolvedConfig:
    """Look every name up, validate every option, refuse combinations that cannot work."""
    exp = components.exporters.get(config.exporter.kind)
    enc = components.encodings.get(config.encoding.kind)
    tr = components.transports.get(config.transport.kind)
    engines = []
    names: set[str] = set()
    for spec in config.engines:
        plan = plan_engine(spec, config.adapter, tr, enc, components)
        if spec.name in names:
            raise ConfigError(f"two engines are named {spec.name!r}; give each a unique `name`")
        names.add(spec.name or "")
        engines.append(plan)
    check_senders(config.sync.senders, None, tr, exp, components)
    for plan in engines:
        check_pause_mode(config.sync.pause_mode, plan.adapter_cls)
        check_senders(config.sync.senders, plan.adapter_cls, tr, exp, components)
    fleet_ref = config.fleet or ComponentRef(kind="static")
    fleet_cls = components.fleets.get(fleet_ref.kind)
    fleet_opts = build_options(fleet_cls, fleet_ref, "fleet")
    check_fleet_engines(fleet_cls, config)
    resolved = ResolvedConfig(config, exp, build_options(exp, config.exporter, "exporter"),
                              enc, build_options(enc, config.encoding, "encoding"),
                              tr, build_options(tr, config.transport, "transport"), engines,
                              fleet_cls, fleet_opts)
    if fleet_ref.kind == "static" and not engines and not tr.publish_only:
        raise ConfigError("the config lists no engines: add an `engines:` list (url of each "
                          "engine), or use `fleet: {kind: registry}` so engines register themselves")
    return resolved


def check_fleet_engines(fleet: Any, config: SyncConfig) -> None:
    if config.engines and not fleet.takes_engines:
        raise ConfigError(f"`engines` lists a static fleet, but `fleet` is {fleet.name!r}, whose "
                          f"members register themselves; drop the `engines` list (or use the "
                          f"static fleet)")


def check_senders(senders: str, adapter: type[Adapter] | None, transport: type[Transport],
                  exporter: type[Exporter], components: Any) -> None:
    """`senders: all` needs an exporter that splits a push, a transport each rank can send
    through on its own, and engines whose rounds take payloads from several ranks."""
    if senders != "all":
        return
    if not exporter.spreads:
        can = [n for n, c in components.exporters.items() if c.spreads]
        raise ConfigError(f"sync.senders: all, but exporter {exporter.name!r} cannot split a push "
                          f"among ranks; use one of {can} or senders: rank0")
    if not transport.spreads:
        can = [n for n, c in components.transports.items() if c.spreads]
        raise ConfigError(f"sync.senders: all, but transport {transport.name!r} sends from one "
                          f"rank only; use one of {can} or senders: rank0")
    if adapter is not None and not issubclass(adapter, SharesRounds):
        raise ConfigError(f"sync.senders: all, but adapter {adapter.name!r} cannot take one "
                          f"round's payloads from several ranks (it lacks SharesRounds); use "
                          f"senders: rank0")


def check_pause_mode(mode: str | None, adapter: type[Adapter]) -> None:
    if mode is not None and mode not in adapter.pause_modes:
        raise ConfigError(f"pause_mode {mode!r} is not supported by adapter {adapter.name!r}; "
                          f"use one of {list(adapter.pause_modes)}")


def missing(adapter: type[Adapter], transport: type[Transport]) -> list[str]:
    """What `adapter` lacks for `transport`: capability types it does not implement, message
    types it cannot deliver (an adapter whose engine runs weightsync's receiver takes any)."""
    out = [f"capability {cap.__name__}" for cap in transport.requires
           if not issubclass(adapter, cap)]
    if adapter.accepts is not None:
        out += [f"message {m.__name__} ({m.kind!r})" for m in transport.messages
                if not issubclass(m, adapter.accepts)]
    return out


def check_combination(adapter: type[Adapter], options: Any, transport: type[Transport],
                      encoding: type[Encoding], spec: EngineSpec, components: Any) -> None:
    lacks = missing(adapter, transport)
    if lacks:
        works = [n for n, t in components.transports.items() if not missing(adapter, t)]
        raise ConfigError(f"adapter {adapter.name!r} cannot receive over transport "
                          f"{transport.name!r} (it lacks {', '.join(lacks)}); "
                          f"transports that work with {adapter.name!r}: {works}")
    if adapter.encodings is not None and encoding.name not in adapter.encodings:
        raise ConfigError(f"adapter {adapter.name!r} cannot apply encoding {encoding.name!r} "
                          f"natively; use one of {sorted(adapter.encodings)}")
    if transport.same_host and spec.host not in LOCAL_HOSTS:
        raise ConfigError(f"transport {transport.name!r} only reaches engines on this host, but "
                          f"engine {spec.name!r} is at {spec.host}; use 'collective' or 'http' for "
                          f"remote engines")
    adapter.check(options, transport, encoding)
