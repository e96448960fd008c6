"""Every trainer rank sends its own part over NIXL (`sync.senders: all`): two gloo rank processes,
each with its own NIXL agent and registered buffers, push the same state dict into two reference
engines; each engine READs every bucket from the rank that owns it, inside the one round rank 0
opened. Checked: every rank's report verified, both ranks sent, the engines hold the pushed bytes
exactly, twice in a row (the second push a new version)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed: install torch first, then "
                                        "`python -m pip install nixl==1.5.1`")

from weightsync.net.server import free_port  # noqa: E402
from weightsync.testing import perturb, sample_state_dict, write_weights_only_model  # noqa: E402
from weightsync_reference.processes import EngineProcess, start_all  # noqa: E402

RANK = textwrap.dedent("""
    import json, sys, torch.distributed as dist
    from weightsync import WeightSync
    from weightsync.testing import perturb, sample_state_dict

    dist.init_process_group("gloo")
    cfg = json.loads(sys.argv[1])
    with WeightSync.from_config(cfg) as sync:
        for v in (1, 2):
            r = sync.push(perturb(sample_state_dict(scale=8), v), version=v)
            print(json.dumps({"rank": dist.get_rank(), "v": v, "ok": r.ok, "verified": r.verified,
                              "senders": r.senders}), flush=True)
    dist.destroy_process_group()
""")


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[EngineProcess]]:
    model = write_weights_only_model(tmp_path / "model", sample_state_dict(scale=8))
    procs = [EngineProcess(model, name=f"engine{i}", log=tmp_path / f"engine{i}.log") for i in range(2)]
    try:
        yield start_all(procs)
    finally:
        for p in procs:
            p.stop()


@pytest.mark.slow
def test_every_rank_reads_into_the_engines_from_its_own_agent(engines: list[EngineProcess],
                                                               tmp_path: Path) -> None:
    cfg = {"transport": {"kind": "nixl", "options": {"device": "cpu"}},
           "engines": [e.spec() for e in engines],
           "exporter": {"kind": "torch", "options": {"bucket_bytes": 64 << 10}},
           "sync": {"progress": "off", "senders": "all", "deadline": 120}}
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), json.dumps(cfg)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for _, e in outs)
    rows = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == 4 and all(r["ok"] and r["verified"] for r in rows), rows
    for r in rows:
        sent = {int(k): n for k, n in r["senders"].items()}
        assert set(sent) == {0, 1} and min(sent.values()) > 0, r
    want = perturb(sample_state_dict(scale=8), 2)
    for e in engines:
        assert e.health()["version"] == 2
        assert e.holds(want)
