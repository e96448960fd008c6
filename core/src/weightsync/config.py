"""SyncConfig: what a user writes (YAML, TOML, JSON or a dict), validated before anything runs. Only
that lives here (no interface is imported): assembly.py turns it into components."""

from __future__ import annotations

import difflib
import json
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Mapping
from urllib.parse import urlparse

import pydantic
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError,
                      model_validator)

from weightsync.errors import ConfigError
from weightsync.sync.metrics import MetricsSettings

if TYPE_CHECKING:
    from weightsync.interfaces.base import Component

__all__ = ["ByteSize", "ComponentRef", "EngineSpec", "LOCAL_HOSTS", "ProbeSettings", "SyncConfig",
           "SyncSettings", "build_options", "explain_errors", "parse_bytes", "read_config_file"]

_BYTES: TypeAdapter[pydantic.ByteSize] = TypeAdapter(pydantic.ByteSize)


def parse_bytes(value: Any) -> int:
    """A size as pydantic's ByteSize reads it; a sentence that says what to write otherwise."""
    try:
        return int(_BYTES.validate_python(value))
    except ValidationError:
        raise ValueError(f"{value!r} is not a size; write bytes or e.g. '64MiB', '1GiB'") from None


ByteSize = Annotated[int, BeforeValidator(parse_bytes), Field(gt=0)]
"""A size in bytes, read by pydantic's ByteSize: 67108864, "64MiB", "64 MB" (10**6), "1GiB",
"1.5GiB"; an int to the code that uses it."""


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
    tolerance: float | None = Field(None, gt=0, description=(
        "the largest |Δ logprob| accepted; None: 0.05 for a float32 model, 0.25 for a 16-bit one "
        "(an engine's own bf16 kernels differ from the trainer's by a few hundredths)"))
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
    senders: Literal["rank0", "all"] = Field("rank0", description=(
        "who sends in a multi-rank trainer: rank0 (every tensor reaches rank 0, which sends it) "
        "or all (each rank sends the buckets it owns; rank 0 runs the round and checks every "
        "rank's digests)"))
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
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise ConfigError(f"config file {path}: use .yaml, .yml, .toml or .json")
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            import yaml
            with open(path) as f:           # a named stream: YAML errors name the file
                data = yaml.safe_load(f)
    except Exception as e:
        raise ConfigError(f"config file {path} could not be parsed: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _explain(e: ValidationError, options: list[str] | None = None) -> str:
    return "; ".join(explain_errors(e, options))


def _misplaced(loc: tuple[Any, ...], key: str) -> str:
    """A hint for an unknown key: a close spelling at its own level, or the section it belongs
    to; inside an engine or a component, anything else is an option of its adapter/component."""
    here = ".".join(str(p) for p in loc[:-1] if not isinstance(p, int))
    models: dict[str, type[BaseModel]] = {"": SyncConfig, "sync": SyncSettings,
                                          "sync.probe": ProbeSettings, "engines": EngineSpec}
    fields = list(models[here].model_fields) if here in models else []
    near = difflib.get_close_matches(key, fields, n=1, cutoff=0.75)
    if near:
        return f"did you mean `{near[0]}`?"
    if here in ("exporter", "encoding", "transport", "adapter", "fleet"):
        return f"a component takes `kind` and `options`; put `{key}` under `{here}.options`"
    homes = [path for path, m in models.items() if key in m.model_fields and path != here]
    if homes:
        return f"`{key}` belongs under `{homes[0] or 'the top level'}`"
    if here == "engines":
        return (f"an engine takes {sorted(EngineSpec.model_fields)}; an adapter option such as "
                f"`{key}` goes under that engine's `options` (or the top-level `adapter.options`)")
    return f"known keys here: {sorted(fields)}"


def explain_errors(e: ValidationError, options: list[str] | None = None) -> list[str]:
    """One sentence per schema error, saying where it is and, for an unknown key, where it
    belongs or what it was probably meant to be (among `options`, for a component's options)."""
    out = []
    for err in e.errors():
        loc = tuple(err["loc"])
        where = ".".join(str(p) for p in loc) or "<root>"
        if err["type"] == "extra_forbidden" and loc and options is not None:
            near = difflib.get_close_matches(str(loc[-1]), options, n=1, cutoff=0.75)
            out.append(f"{where}: unknown option" + (f"; did you mean `{near[0]}`?" if near else ""))
        elif err["type"] == "extra_forbidden" and loc:
            out.append(f"{where}: unknown key; {_misplaced(loc, str(loc[-1]))}")
        else:
            out.append(f"{where}: {err['msg']}")
    return out


def build_options(cls: type[Component], ref: ComponentRef, kind: str,
                  extra: Mapping[str, Any] | None = None) -> Any:
    try:
        return cls.Options.model_validate({**ref.options, **(extra or {})})
    except ValidationError as e:
        allowed = sorted(cls.Options.model_fields)
        raise ConfigError(f"{kind} {ref.kind!r}: bad options: {_explain(e, allowed)}; "
                          f"allowed options: {allowed}") from None
