"""Transport `nixl` into reference-engine processes that load this plugin through its entry
point: raw and delta encodings, bit-exact, with the report every transport gives; the
transport's own message (`nixl.read`) is checked field by field in the engine, and neither core
nor any engine plugin knows it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed: install torch first, then "
                                        "`python -m pip install nixl==1.5.1`")

from weightsync import EngineError, WeightSync  # noqa: E402
from weightsync.config import EngineSpec  # noqa: E402
from weightsync.plugins import load_components  # noqa: E402
from weightsync.testing import perturb, sample_state_dict, write_weights_only_model  # noqa: E402
from weightsync_reference.adapter import ReferenceAdapter  # noqa: E402
from weightsync_reference.processes import EngineProcess, start_all  # noqa: E402

from weightsync_nixl.agent import agent  # noqa: E402
from weightsync_nixl.messages import NixlRead, b64  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_weights_only_model(tmp_path_factory.mktemp("model"), sample_state_dict(scale=8))


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[list[EngineProcess]]:
    """Two engines for the module: each test starts from the version they hold."""
    logs = tmp_path_factory.mktemp("logs")
    procs = [EngineProcess(model, name=f"engine{i}", log=logs / f"engine{i}.log")
             for i in range(2)]
    try:
        yield start_all(procs)
    finally:
        for p in procs:
            p.stop()


def config(engines: list[EngineProcess], encoding: dict[str, Any]) -> dict[str, Any]:
    return {"transport": {"kind": "nixl", "options": {"device": "cpu"}}, "encoding": encoding,
            "engines": [e.spec() for e in engines],
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 64 << 10}},
            "sync": {"progress": "off", "failure_policy": "continue", "deadline": 120}}


@pytest.mark.parametrize("encoding", ["raw", "delta"])
def test_raw_and_delta_reach_reference_engines_bit_exact(
        model: Path, engines: list[EngineProcess], encoding: str) -> None:
    if encoding == "delta" and "delta" not in load_components().encodings:
        pytest.skip(reason="encoding 'delta' (weightsync-disk-delta) is not installed")
    enc = ({"kind": "raw"} if encoding == "raw"
           else {"kind": "delta", "options": {"base_checkpoint": str(model)}})
    sd = sample_state_dict(scale=8)
    held = engines[0].health()["version"]
    with WeightSync.from_config(config(engines, enc)) as sync:
        for v in (held + 1, held + 2, held + 3):
            sd = perturb(sd, v)
            report = sync.push(sd, version=v)
            assert report.ok and report.verified, report.summary()
            assert {n: (o.status, o.version) for n, o in report.engines.items()} == {
                "engine0": ("verified", v), "engine1": ("verified", v)}, report.summary()
            assert report.buckets > 1 and report.wire_bytes > 0 and report.digests
            assert report.seconds.get("total", 0) > 0, report.seconds
            for e in engines:
                assert e.health()["version"] == v and e.health()["paused"] is None
                assert e.holds(sd), f"{e.name} differs from the trainer at version {v}"


def test_a_forged_or_malformed_read_is_refused_and_the_engine_keeps_its_version(
        engines: list[EngineProcess]) -> None:
    """The engine checks every field of `nixl.read` before a byte moves; descriptors that point
    at memory the trainer never registered are refused by NIXL (and named so)."""
    me = agent("trainer")
    adapter = ReferenceAdapter(engine=EngineSpec(**engines[0].spec()))
    held = engines[0].health()["version"]
    adapter.begin(held + 1, {"transport": {"kind": "nixl", "options": {}}, "encoding": {"kind": "raw"}})
    header = {"index": 0, "last": True, "encoding": "raw", "digest": "xxh3:00", "tensors": [],
              "nbytes": 64, "meta": {}}
    good = {"header": header, "agent": me.name, "metadata": b64(me.metadata()), "mem": "DRAM",
            "descs": [[4096, 64, 0]], "notif": "ws:test", "deadline": 5.0}
    cases = {"not a weightsync agent": {"agent": "../../etc"},
             "not valid base64": {"metadata": "***"},
             "descriptors cover 32 bytes, the payload has 64": {"descs": [[4096, 32, 0]]},
             "must be an integer": {"descs": [[4096, 64.5, 0]]},
             "nbytes must be an integer in": {"header": {**header, "nbytes": -1}},
             "memory type": {"mem": "DISK"},
             "deadline must be seconds": {"deadline": 1e9},
             "no registered memory at the descriptors sent": {}}
    try:
        for why, change in cases.items():
            with pytest.raises(EngineError, match=f"HTTP 400.*{re.escape(why)}"):
                adapter.deliver(NixlRead({**good, **change}))
    finally:
        adapter.abort()
        adapter.close()
    assert engines[0].health()["version"] == held and engines[0].health()["round"] is None


def test_neither_core_nor_any_engine_plugin_names_the_nixl_message() -> None:
    """What makes the tests above a proof that a transport with its own engine-side message
    needs no change to core or to an engine plugin."""
    sources = [ROOT / "core" / "src", *sorted((ROOT / "plugins").glob("*/src"))]
    named = [str(f.relative_to(ROOT)) for d in sources for f in d.rglob("*.py")
             if "weightsync_nixl" not in f.parts
             and re.search(r"nixl\.read|NixlRead|weightsync_nixl", f.read_text())]
    assert named == []
