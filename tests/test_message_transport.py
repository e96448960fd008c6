"""Issue 38's proof that the Adapter is a fixed round protocol: a transport that needs its own
engine-side message works against the reference engine with no change to `Adapter` or to any
engine plugin. The transport is the tutorial's `echo` (docs/examples/weightsync-echo): its
sending half writes each payload body to a file and delivers an `echo.file` message naming it;
its receiving half, loaded into each engine process from its source tree
(`WEIGHTSYNC_PLUGIN_MODULES`, nothing installed), parses that message and stages the file. The
same proof against a live vLLM is plugins/vllm/tests/test_live_vllm.py."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from weightsync import EngineError, WeightSync
from weightsync.config import EngineSpec
from weightsync.plugins import load_components, make_plugin_manager
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model
from weightsync_reference.adapter import ReferenceAdapter
from weightsync_reference.processes import EngineProcess, start_all

ROOT = Path(__file__).resolve().parents[1]
ECHO_SRC = ROOT / "docs" / "examples" / "weightsync-echo" / "src"
ECHO_ENV = {"PYTHONPATH": os.pathsep.join([str(ECHO_SRC), os.environ.get("PYTHONPATH", "")]),
            "WEIGHTSYNC_PLUGIN_MODULES": "weightsync_echo.plugin"}


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The trainer's side: the echo plugin from its source tree, registered like any plugin."""
    monkeypatch.syspath_prepend(str(ECHO_SRC))
    import weightsync_echo.plugin
    import weightsync_echo.transport
    pm = make_plugin_manager()
    if pm.get_plugin("echo") is None:             # not installed here: register it by hand
        pm.register(weightsync_echo.plugin, name="echo")
    return load_components(pm), weightsync_echo.transport


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_weights_only_model(tmp_path / "model", sample_state_dict())


@pytest.fixture
def engines(tmp_path: Path, model: Path) -> Iterator[list[EngineProcess]]:
    procs = start_all([EngineProcess(model, name=f"engine{i}", log=tmp_path / f"engine{i}.log",
                                     env=ECHO_ENV) for i in range(2)])
    yield procs
    for p in procs:
        p.stop()


def _config(tmp_path: Path, engines: list[EngineProcess]) -> dict[str, Any]:
    return {"transport": {"kind": "echo", "options": {"directory": str(tmp_path / "echo")}},
            "engines": [e.spec() for e in engines],
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 8192}},
            "sync": {"progress": "off", "failure_policy": "continue"}}


def test_a_transport_with_its_own_message_reaches_reference_engines_bit_exact(
        tmp_path: Path, engines: list[EngineProcess], echo: Any) -> None:
    components, _ = echo
    sd = sample_state_dict()
    with WeightSync.from_config(_config(tmp_path, engines), components=components) as sync:
        for v in (1, 2, 3):
            sd = perturb(sd, v)
            report = sync.push(sd, version=v)
            assert {n: o.status for n, o in report.engines.items()} == {
                "engine0": "verified", "engine1": "verified"}, report.summary()
            for e in engines:
                assert e.health()["version"] == v
                assert e.holds(sd), f"{e.name} differs from the trainer at version {v}"
    assert not list((tmp_path / "echo").iterdir()), "a payload file was left behind"


def test_a_hostile_message_is_refused_and_the_engine_keeps_its_version(
        tmp_path: Path, engines: list[EngineProcess], echo: Any) -> None:
    """The receiving half checks what the message names: a path out of its directory is a 400
    that says why, and the round that carried it commits nothing."""
    _, transport = echo
    adapter = ReferenceAdapter(engine=EngineSpec(**engines[0].spec()))
    plan = {"transport": {"kind": "echo", "options": {"directory": str(tmp_path / "echo")}},
            "encoding": {"kind": "raw", "options": {}}}
    adapter.begin(1, plan)
    try:
        with pytest.raises(EngineError, match="HTTP 400.*refusing file name '../secret'"):
            adapter.deliver(transport.EchoFile({"file": "../secret", "header": {"nbytes": 1}}))
        with pytest.raises(EngineError, match="HTTP 400.*takes no message 'echo.unknown'"):
            adapter.deliver(type("Unknown", (transport.EchoFile,), {"kind": "echo.unknown"})({}))
    finally:
        adapter.abort()
    assert engines[0].health()["version"] == 0
    adapter.close()


def test_an_engine_without_the_plugin_fails_at_begin_and_the_other_is_pushed(
        tmp_path: Path, model: Path, echo: Any) -> None:
    components, _ = echo
    with_plugin = EngineProcess(model, name="with", log=tmp_path / "with.log", env=ECHO_ENV)
    without = EngineProcess(model, name="without", log=tmp_path / "without.log")
    start_all([with_plugin, without])
    try:
        with WeightSync.from_config(_config(tmp_path, [with_plugin, without]),
                                    components=components) as sync:
            report = sync.push(perturb(sample_state_dict(), 1), version=1)
        assert report.engines["with"].status == "verified"
        failed = report.engines["without"]
        assert failed.status == "failed" and failed.stage == "begin"
        assert "unknown transport 'echo'" in str(failed.error)
        assert (with_plugin.health()["version"], without.health()["version"]) == (1, 0)
    finally:
        with_plugin.stop()
        without.stop()


def test_neither_core_nor_any_engine_plugin_names_the_echo_message() -> None:
    """What makes the tests above a proof: the message is known only to the echo plugin."""
    sources = [ROOT / "core" / "src", *sorted((ROOT / "plugins").glob("*/src"))]
    named = [str(f.relative_to(ROOT)) for d in sources for f in d.rglob("*.py")
             if re.search(r"echo\.file|EchoFile|weightsync_echo", f.read_text())]
    assert named == []
