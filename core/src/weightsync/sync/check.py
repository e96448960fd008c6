"""`weightsync check`: every problem of a sync config at once, each a sentence that says what
to change (the pipeline itself stops at the first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from weightsync.sync.assembly import check_fleet_engines, check_pause_mode, plan_engine
from weightsync.config import SyncConfig, build_options, read_config_file
from weightsync.errors import WeightSyncError


def check_config(source: str | Path) -> tuple[list[str], str]:
    """(problems, a one-line summary when there are none)."""
    from weightsync.plugins import load_components
    try:
        data = read_config_file(Path(source))
    except WeightSyncError as e:
        return [str(e)], ""
    try:
        config = SyncConfig.model_validate(data)
    except ValidationError as e:
        return [f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                for err in e.errors()], ""
    components = load_components()
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


__all__ = ["check_config"]
