"""`weightsync check`: every problem of a sync config at once, each a sentence that says what
to change (the pipeline itself stops at the first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from weightsync.sync.assembly import check_fleet_engines, check_pause_mode, plan_engine
from weightsync.config import ComponentRef, SyncConfig, build_options, explain_errors, read_config_file
from weightsync.errors import WeightSyncError


def check_config(source: str | Path) -> tuple[list[str], str]:
    """(problems, a one-line summary when there are none)."""
    from weightsync.plugins import load_components
    try:
        data = read_config_file(Path(source))
    except WeightSyncError as e:
        return [str(e)], ""
    components = load_components()
    try:
        config = SyncConfig.model_validate(data)
    except ValidationError as e:       # the schema's problems, and the names it could read
        return explain_errors(e) + _unknown_names(data, components), ""
    problems: list[str] = []
    found: dict[str, Any] = {}
    for kind, ref in (("exporter", config.exporter), ("encoding", config.encoding),
                      ("transport", config.transport)):
        try:
            cls = components.registry(kind).get(ref.kind)
            build_options(cls, ref, kind)
            found[kind] = cls
        except WeightSyncError as e:
            problems.append(str(e))
    fleet = config.fleet.kind if config.fleet else "static"
    try:
        fcls = components.fleets.get(fleet)
        if config.fleet is not None:
            build_options(fcls, config.fleet, "fleet")
        check_fleet_engines(fcls, config)
    except WeightSyncError as e:
        problems.append(str(e))
    names: set[str] = set()
    if "transport" in found and "encoding" in found:
        for i, spec in enumerate(config.engines):
            try:
                plan = plan_engine(spec, config.adapter, found["transport"], found["encoding"], components)
                check_pause_mode(config.sync.pause_mode, plan.adapter_cls)
            except WeightSyncError as e:
                problems.append(f"engines[{i}] ({spec.name}): {e}")
            if spec.name in names:
                problems.append(f"engines[{i}]: two engines are named {spec.name!r}; give each a "
                                f"unique `name`")
            names.add(spec.name or "")
        if fleet == "static" and not config.engines and not found["transport"].publish_only:
            problems.append("the config lists no engines: add an `engines:` list (url of each "
                            "engine), or use `fleet: {kind: registry}` so engines register themselves")
    summary = (f"exporter {config.exporter.kind}, encoding {config.encoding.kind}, transport "
               f"{config.transport.kind}, fleet {fleet}, engines {[s.name for s in config.engines]}")
    return problems, summary


def _unknown_names(data: dict[str, Any], components: Any) -> list[str]:
    """Components named in a config that failed its schema: still checked, so one pass says all."""
    out = []
    for kind in [k for k in ("exporter", "encoding", "transport", "adapter", "fleet") if k in data]:
        try:
            components.registry(kind).get(ComponentRef.model_validate(data[kind]).kind)
        except (ValidationError, WeightSyncError) as e:
            if isinstance(e, WeightSyncError):
                out.append(str(e))
    return out


def contact(sync: Any) -> tuple[list[str], list[str]]:
    """(problems, lines) of a `WeightSync`'s fleet: each engine asked for its health and version,
    and for access where its adapter can check a credential harmlessly (`ChecksAccess`)."""
    from weightsync.interfaces import ChecksAccess
    problems: list[str] = []
    lines: list[str] = []
    try:
        engines = sync.members()
    except WeightSyncError as e:
        return [f"fleet: {e}"], lines
    if not engines and not sync.transport.publish_only:
        problems.append("the fleet has no members: no engine is registered or listed")
    for a in engines:
        where = f"engine {a.engine_name} ({getattr(a, 'base', '?')})"
        try:
            st = a.health()
            if isinstance(a, ChecksAccess):
                a.check_access()
        except WeightSyncError as e:
            problems.append(f"{where}: {e}")
            continue
        access = "access ok" if isinstance(a, ChecksAccess) else "access not checkable"
        lines.append(f"{where}: reachable, version {st.version}, {access}")
    return problems, lines


__all__ = ["check_config", "contact"]
