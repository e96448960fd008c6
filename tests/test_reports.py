"""Reports that never overstate: every field of SyncReport.to_json, the per-engine outcome and
seconds, the summary line, a publish-only push (ok, published, not verified), and follower ranks
of a multi-rank trainer (they report what rank 0 reported, received over the trainer's group)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from weightsync import WeightSync
from weightsync.sync.report import EngineOutcome, SyncReport
from weightsync_reference.processes import EngineProcess
from weightsync.net.server import free_port
from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model

FIELDS = {"version", "verified", "logical_bytes", "wire_bytes", "buckets", "tensors", "seconds",
          "pause_window", "engines", "digests", "density", "published", "rank", "joined", "left",
          "excluded", "ok", "probe", "senders"}
OUTCOME_FIELDS = {"engine", "ok", "version", "stage", "error", "seconds", "status", "caught_up",
                  "pause_window", "probe", "peer", "peer_error", "remark"}


def test_to_json_field_by_field(tmp_path: Path) -> None:
    sd = sample_state_dict()
    with EngineProcess(write_weights_only_model(tmp_path / "m", sd), name="e",
                       log=tmp_path / "e.log") as eng:
        cfg = {"engines": [eng.spec()], "sync": {"progress": "off"},
               "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}}
        with WeightSync.from_config(cfg) as sync:
            new = perturb(sd, 1)
            r = sync.push(new, version=1)
    d = json.loads(json.dumps(r.to_json()))               # plain JSON all the way down
    assert set(d) == FIELDS
    assert d["version"] == 1 and d["verified"] is True and d["ok"] is True
    nbytes = sum(t.numel() * t.element_size() for t in new.values())
    assert d["logical_bytes"] == nbytes and d["wire_bytes"] >= nbytes
    assert d["buckets"] == len(d["digests"]) > 1 and d["tensors"] == len(new)
    assert set(d["digests"]) == {str(i) for i in range(d["buckets"])}
    stages = {"health", "begin", "open", "export", "encode", "send", "finish", "verify", "pause",
              "commit", "resume", "total"}
    assert stages <= set(d["seconds"]) and all(v >= 0 for v in d["seconds"].values())
    assert 0 < d["pause_window"] < d["seconds"]["total"]
    assert d["density"] is None and d["published"] is False and d["rank"] == 0
    assert d["joined"] == [] and d["left"] == [] and d["excluded"] == {}
    o = d["engines"]["e"]
    assert set(o) == OUTCOME_FIELDS
    assert 0 < o["pause_window"] == d["pause_window"]      # one engine: its window is the push's
    assert o == {"engine": "e", "ok": True, "version": 1, "stage": None, "error": None,
                 "seconds": o["seconds"], "status": "verified", "caught_up": False,
                 "pause_window": o["pause_window"], "probe": None,    # a state dict is not probed
                 "peer": None, "peer_error": None, "remark": None}
    assert d["probe"] == "skipped: the pushed model is not a causal LM the trainer can score"
    assert d["senders"] == {}                  # one process: no rank sent on its own
    assert 0 < o["seconds"] <= d["seconds"]["total"]
    back = SyncReport.from_json(d)
    assert back.to_json() == d
    line = r.summary()
    assert line.startswith("v1: ") and f"{d['buckets']} buckets" in line
    assert "pause " in line and "1/1 engines (1 verified)" in line


def test_summary_names_failures_and_outcomes() -> None:
    r = SyncReport(version=3, logical_bytes=2**20, wire_bytes=2**19, buckets=2,
                   seconds={"total": 0.5}, pause_window=0.01)
    r.engines = {"a": EngineOutcome("a", True, 3, status="verified"),
                 "b": EngineOutcome("b", True, 3, status="acknowledged"),
                 "c": EngineOutcome("c", False, 2, "send", "connection reset", status="failed")}
    assert not r.ok and r.failed == ["c"] and r.versions() == {"a": 3, "b": 3, "c": 2}
    s = r.summary()
    assert s.splitlines()[0] == ("v3: 1.0 MiB logical, 0.5 MiB wire, 2 buckets, 0.500s, pause "
                                 "0.010s, 2/3 engines (1 verified, 1 acknowledged, 1 failed)")
    assert s.splitlines()[1] == "  c failed at send (holds version 2): connection reset"


def test_a_publish_only_push_is_ok_and_published_not_verified(tmp_path: Path) -> None:
    pytest.importorskip("weightsync_disk_delta")
    cfg = {"transport": {"kind": "disk_delta", "options": {"root": str(tmp_path / "root")}},
           "encoding": "delta", "sync": {"progress": "off"},
           "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}}
    with WeightSync.from_config(cfg) as sync:
        r = sync.push(sample_state_dict(), version=1)
    assert r.ok and r.published and not r.verified and r.engines == {}
    assert ", published" in r.summary().splitlines()[0]
    assert r.to_json()["ok"] is True


def _rank(rank: int, port: int, url: str, out: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = {"engines": [{"url": url, "name": "e"}], "sync": {"progress": "off"},
           "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}}}
    sd = perturb(sample_state_dict(), 1)
    reports = []
    with WeightSync.from_config(cfg) as sync:
        reports.append(sync.push(sd, version=1).to_json())
        with torch.no_grad():
            sd["model.norm.weight"] = torch.zeros(3)     # a bad version: the engine refuses it
        try:
            sync.push(sd, version=2)
            reports.append("no error")
        except Exception as e:  # noqa: BLE001 - the report travels with the error
            reports.append(getattr(e, "report").to_json())
    Path(out).write_text(json.dumps(reports))
    dist.destroy_process_group()


def test_follower_ranks_report_what_rank_0_reported(tmp_path: Path) -> None:
    sd = sample_state_dict()
    with EngineProcess(write_weights_only_model(tmp_path / "m", sd), name="e",
                       log=tmp_path / "e.log") as eng:
        port = free_port()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, port, eng.url, str(tmp_path / f"r{r}.json")))
                 for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
        assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    for a, b in zip(r0, r1):
        assert a["rank"] == 0 and b["rank"] == 1
        assert {**a, "rank": 1} == b
    assert r0[0]["ok"] and r0[0]["verified"]
    assert not r1[1]["ok"] and r1[1]["engines"]["e"]["stage"] == "send"
    assert "model.norm.weight" in r1[1]["engines"]["e"]["error"]


def test_from_json_tolerates_only_its_own_fields() -> None:
    with pytest.raises(TypeError):
        SyncReport.from_json({"version": 1, "nonsense": 2})
