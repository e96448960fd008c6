"""Every trainer rank sends its own part (issue 41 item 2, `sync.senders: all`): three real gloo
ranks holding an FSDP2-sharded tiny Qwen3-MoE push into two reference engines with the delta
encoding, over http in a chain (each rank's buckets relayed e0 -> e1). Checked: the engines hold what save_pretrained writes, bit for bit, after two pushes;
every rank sent about a third of the bytes and kept a delta base of its own tensors only; a rank
whose export raises fails the push on every rank with its error, nothing committed; a rank that
dies mid-push fails it on the others (`RanksLost`), and so does one frozen in its export (rank 0
gives up at the push's deadline); every engine is left on its old version and serving (not
paused, no round open)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from weightsync.net.server import free_port
from weightsync.testing import write_weights_only_model
from weightsync_reference.processes import EngineProcess, start_all

pytest.importorskip("transformers")

WORLD = 3
MODEL = dict(layers=2, experts=4, hidden=64, vocab=512)

RANK = textwrap.dedent("""
    import json, os, sys, time, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from weightsync import SyncError, WeightSync
    from weightsync_reference.models import fill_deterministic, tiny_moe_config

    engines, spec, mode = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def build(seed):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_moe_config(**spec))
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        return fill_deterministic(model, seed=seed)

    def say(**kw):
        print(json.dumps({"rank": rank, **kw}), flush=True)

    cfg = {"engines": engines, "encoding": {"kind": "delta"},
           "transport": {"kind": "http", "options": {"shape": "chain", "stall": 20}},
           "sync": {"progress": "off", "senders": "all", "lease": 5, "deadline": 120},
           "exporter": {"kind": "torch", "options": {"bucket_bytes": 32768}}}
    if mode == "freeze":             # rank 2 stops answering inside its export
        cfg["sync"]["deadline"] = 15
        sync = WeightSync.from_config(cfg)

        def freeze(name, t):
            if rank == 2 and t.device.type != "meta":
                time.sleep(600)
            return [(name, t)]
        t0 = time.monotonic()
        try:
            sync.push(build(3), version=5, name_map=freeze)
            say(case="freeze", failed=False)
        except SyncError as e:
            say(case="freeze", failed=True, error=str(e), kind=type(e).__name__,
                seconds=time.monotonic() - t0)
        os._exit(0)
    sync = WeightSync.from_config(cfg)
    for version, seed in ((1, 1), (2, 2)):
        r = sync.push(build(seed), version=version)
        say(case=f"v{version}", ok=r.ok, verified=r.verified, senders=r.senders, wire=r.wire_bytes,
            buckets=r.buckets, kept=len(sync.encoding._base or {}),
            relay_events=sync.transport.relay_events)
    model = build(3)

    def refuse(name, t):
        if rank == 1 and name == "lm_head.weight":
            raise ValueError("rank 1 cannot export lm_head.weight")
        return [(name, t)]
    try:
        sync.push(model, version=3, name_map=refuse)
        say(case="raise", failed=False)
    except SyncError as e:
        say(case="raise", failed=True, error=str(e))

    def die(name, t):
        if rank == 2 and t.device.type != "meta" and "layers.1." in name:
            os._exit(3)                  # a rank lost mid-push: no goodbye to anyone
        return [(name, t)]
    try:
        sync.push(model, version=4, name_map=die)
        say(case="die", failed=False)
    except SyncError as e:
        say(case="die", failed=True, error=str(e), kind=type(e).__name__)
    os._exit(0)                          # the group is broken: no collective teardown
""")


def _expected(seed: int, tmp: Path) -> dict[str, torch.Tensor]:
    """What save_pretrained writes for the unsharded model with the same values."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from weightsync_reference.models import fill_deterministic, tiny_moe_config
    model = AutoModelForCausalLM.from_config(tiny_moe_config(**MODEL))
    fill_deterministic(model, seed=seed).save_pretrained(tmp / f"ref{seed}")
    return {k: v for f in sorted((tmp / f"ref{seed}").glob("*.safetensors"))
            for k, v in load_file(f).items()}


def _launch(script: Path, specs: str, env: dict[str, str], mode: str, wait: list[int] | None = None
            ) -> tuple[list[tuple[str, str]], list[int | None]]:
    """The WORLD rank processes on `mode` (a fresh rendezvous port); waits for the ranks in
    `wait` (default: all), then kills whatever still runs. Returns each rank's (stdout, stderr),
    kept in files next to the script, and exit code."""
    port = str(free_port())
    logs = [(open(script.with_suffix(f".{mode}.{r}.out"), "w+"), open(script.with_suffix(f".{mode}.{r}.err"), "w+"))
            for r in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, str(script), specs, json.dumps(MODEL), mode],
                              env={**env, "RANK": str(r), "MASTER_PORT": port},
                              stdout=logs[r][0], stderr=logs[r][1], text=True) for r in range(WORLD)]
    try:
        for r in (wait if wait is not None else range(WORLD)):
            procs[r].wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    outs = []
    for out, err in logs:
        out.seek(0)
        err.seek(0)
        outs.append((out.read(), err.read()))
        out.close()
        err.close()
    return outs, [p.returncode for p in procs]


@pytest.mark.slow
def test_every_rank_sends_its_own_part(tmp_path: Path) -> None:
    want = _expected(2, tmp_path)
    zeros = {k: torch.zeros_like(v) for k, v in want.items()}
    engines = [EngineProcess(write_weights_only_model(tmp_path / f"e{i}", zeros),
                             log=tmp_path / f"e{i}.log") for i in range(2)]
    start_all(engines)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1"}
    specs = json.dumps([{"url": e.url, "name": f"e{i}"} for i, e in enumerate(engines)])
    try:
        outs, codes = _launch(script, specs, env, "full")
        assert codes == [0, 0, 3], "\n".join(err[-3000:] for _, err in outs)
        rows = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
        case = {(r["case"], r["rank"]): r for r in rows}

        # two pushes: every rank's report ok and verified, each rank sent about a third
        for v in ("v1", "v2"):
            lead = case[(v, 0)]
            assert all(case[(v, r)]["ok"] and case[(v, r)]["verified"] for r in range(WORLD)), v
            sent = {int(k): n for k, n in lead["senders"].items()}
            assert set(sent) == {0, 1, 2} and sum(sent.values()) == lead["wire"] > 0
            assert max(sent.values()) <= 0.5 * lead["wire"], sent
            # every rank's buckets went down the chain e0 -> e1: no relay refused, none stalled
            assert all(case[(v, r)]["relay_events"] == [] for r in range(WORLD)), v
        # the delta base: each rank keeps its own tensors only, together the whole model once
        kept = [case[("v2", r)]["kept"] for r in range(WORLD)]
        assert sum(kept) == len(want) and max(kept) < len(want), kept
        for e in engines:
            assert e.holds(want)

        # a rank whose export raises: every rank fails with its error, nothing committed
        for r in range(WORLD):
            got = case[("raise", r)]
            assert got["failed"] and "trainer rank 1" in got["error"], got
            assert "lm_head.weight" in got["error"]
        # a rank that dies mid-push: the others' pushes fail, nothing committed
        for r in (0, 1):
            got = case[("die", r)]
            assert got["failed"] and got["kind"] == "RanksLost", got
        assert "nothing was committed" in case[("die", 0)]["error"]
        for e in engines:
            h = e.health()
            assert h["version"] == 2 and not h["paused"], h
            assert e.holds(want)

        # a rank frozen in its export: rank 0 gives up at the deadline (15 s) with RanksLost,
        # nothing committed, every engine serving; the frozen rank is killed here
        outs, codes = _launch(script, specs, env, "freeze", wait=[0, 1])
        assert codes[:2] == [0, 0], "\n".join(err[-3000:] for _, err in outs)
        rows = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
        lead = next(r for r in rows if r["rank"] == 0)
        assert lead["failed"] and lead["kind"] == "RanksLost" and lead["seconds"] < 60, lead
        assert next(r for r in rows if r["rank"] == 1)["failed"]
        for e in engines:
            h = e.health()
            assert h["version"] == 2 and not h["paused"], h
    finally:
        for e in engines:
            e.stop()
