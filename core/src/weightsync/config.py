"""SyncConfig: what a user writes (YAML, TOML, JSON or a dict), validated before anything runs."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping
from urllib.parse import urlparse

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from .errors import ConfigError
from .interfaces import Adapter, Encoding, Exporter, Transport
from .metrics import MetricsSettings

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_bytes(value: Any) -> int:
    """Accepts 67108864, "64MiB", "64 MB", "1GiB"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size; write bytes or e.g. '64MiB', '1GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


ByteSize = Annotated[int, BeforeValidator(parse_bytes), Field(gt=0)]
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


class ComponentRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, v: Any) -> Any:
        return {"kind": v} if isinstance(v, str) else v


class EngineSpec(BaseModel):
    """One engine of a static fleet. `options` override the adapter's options for this engine."""

    model_config = ConfigDict(extra="forbid")
    url: str
    name: str | None = None
    api_key: str | None = None
    adapter: ComponentRef | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    verify: bool | str = Field(True, description="https: check the engine's certificate (true), "
                                                 "against this CA bundle (a path), or not (false)")

    @model_validator(mode="after")
    def _default_name(self) -> "EngineSpec":
        u = urlparse(self.url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"engine url {self.url!r} must look like http://host:port")
        if self.name is None:
            self.name = f"{u.hostname}:{u.port or 80}"
        return self

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or ""


class ProbeSettings(BaseModel):
    """After commit, engines that can score a sequence score a fixed probe sequence; the trainer
    compares the logprobs with its own (docs/rl.md)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["auto", "on", "off"] = Field("auto", description=(
        "auto: probe when the pushed model is a causal LM and the engine can score; on: a push "
        "that cannot be probed fails; off: never"))
    length: int = Field(24, ge=2, le=4096, description="tokens in the probe sequence")
    tolerance: float = Field(0.05, gt=0, description="the largest |Δ logprob| accepted")
    seed: int = Field(0, ge=0, description="the probe sequence's seed")


class SyncSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    verify: bool = Field(True, description="compare every engine's digests with the sender's")
    pause_mode: str | None = Field(None, description="how engines pause (abort, keep, ...); None: "
                                                     "each adapter's first mode")
    pause: Literal["swap", "sync"] = Field(
        "swap", description="swap: engines that stage a round are paused only around the commit; "
                            "sync: every engine is paused before the first byte (the old way)")
    lease: float = Field(10.0, gt=0, le=3600, description=(
        "seconds an engine keeps this trainer's round or pause without renewal; the pipeline "
        "renews every third of it, and an engine whose lease lapses aborts and resumes itself"))
    deadline: float = Field(600.0, gt=0, description=(
        "seconds a whole push may take; an engine that has not answered by then is dropped and "
        "reported, the others finish"))
    hmac_key_file: str | None = Field(None, description=(
        "a key shared with the engines: every payload is signed, and engines holding the key "
        "refuse unsigned or forged ones (also $WEIGHTSYNC_HMAC_KEY)"))
    failure_policy: Literal["raise", "continue"] = "raise"
    progress: Literal["auto", "on", "off"] = "auto"
    max_inflight_buckets: int = Field(2, ge=1, le=8)
    probe: ProbeSettings = Field(default_factory=ProbeSettings)
    metrics: "MetricsSettings | None" = Field(None, description=(
        "a JSON line per push to a file, and/or Prometheus metrics on a port"))


class SyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    exporter: ComponentRef = ComponentRef(kind="torch")
    encoding: ComponentRef = ComponentRef(kind="raw")
    transport: ComponentRef = ComponentRef(kind="http")
    adapter: ComponentRef = ComponentRef(kind="reference")
    engines: list[EngineSpec] = Field(default_factory=list)
    fleet: ComponentRef | None = Field(None, description=(
        "where the engines come from: static (the `engines` list, the default) or registry "
        "(members register at run time), or a plugin's fleet source"))
    sync: SyncSettings = Field(default_factory=SyncSettings)


    @classmethod
    def load(cls, source: "str | Path | Mapping[str, Any] | SyncConfig") -> "SyncConfig":
        if isinstance(source, SyncConfig):
            return source
        data = source if isinstance(source, Mapping) else read_config_file(Path(source))
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(f"invalid sync config: {_explain(e)}") from None


def read_config_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give the path of a .yaml, .toml "
                          f"or .json file")
    text = path.read_text()
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml
            with open(path) as f:           # a named stream: YAML errors name the file
                data = yaml.safe_load(f)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: use .yaml, .yml, .toml or .json")
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"config file {path} could not be parsed: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _explain(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                     for err in e.errors())


def build_options(cls: type, ref: ComponentRef, kind: str, extra: Mapping[str, Any] | None = None) -> Any:
    options = {**ref.options, **(extra or {})}
    try:
        return cls.Options.model_validate(options)
    except ValidationError as e:
        raise ConfigError(f"{kind} {ref.kind!r}: bad options: {_explain(e)}; "
                          f"allowed options: {sorted(cls.Options.model_fields)}") from None


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
    mode = config.sync.pause_mode
    for plan in engines:
        check_pause_mode(mode, plan.adapter_cls)
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
    if config.engines and not getattr(fleet, "takes_engines", False):
        raise ConfigError(f"`engines` lists a static fleet, but `fleet` is {fleet.name!r}, whose "
                          f"members register themselves; drop the `engines` list (or use the "
                          f"static fleet)")


def check_pause_mode(mode: str | None, adapter: type[Adapter]) -> None:
    if mode is not None and mode not in adapter.pause_modes:
        raise ConfigError(f"pause_mode {mode!r} is not supported by adapter {adapter.name!r}; "
                          f"use one of {list(adapter.pause_modes)}")


def check_combination(adapter: type[Adapter], options: Any, transport: type[Transport],
                      encoding: type[Encoding], spec: EngineSpec, components: Any) -> None:
    if transport.requires not in adapter.capabilities:
        works = [n for n, t in components.transports.items() if t.requires in adapter.capabilities]
        raise ConfigError(f"adapter {adapter.name!r} cannot receive over transport "
                          f"{transport.name!r} (it needs the adapter to support {transport.requires!r}); "
                          f"transports that work with {adapter.name!r}: {works}")
    if adapter.encodings is not None and encoding.name not in adapter.encodings:
        raise ConfigError(f"adapter {adapter.name!r} cannot apply encoding {encoding.name!r} "
                          f"natively; use one of {sorted(adapter.encodings)}")
    if transport.same_host and spec.host not in LOCAL_HOSTS:
        raise ConfigError(f"transport {transport.name!r} only reaches engines on this host, but "
                          f"engine {spec.name!r} is at {spec.host}; use 'collective' or 'http' for "
                          f"remote engines")
    adapter.check(options, transport, encoding)
