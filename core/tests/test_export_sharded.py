"""Sharded MoE trainers (issue 15, item 2): two real ranks on gloo, a tiny Qwen3-MoE whose experts
are split between them (FSDP2, or plain expert parallelism with replicated dense weights), pushed
into a real reference-engine process. Checked: the engine ends bit-exact with what save_pretrained
writes for the same weights; every byte rank 1 holds is sent to rank 0 exactly once and nothing is
all-gathered (no `full_tensor`, rank 1 receives nothing); each rank's peak extra memory (VmHWM
after resetting it) stays within its bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from weightsync.testing import write_weights_only_model

from weightsync.net.server import free_port

from weightsync_reference.processes import EngineProcess

pytest.importorskip("transformers")

MiB = 2**20
BUCKET = 1 * MiB
# a model whose fused experts (16 MiB per layer) dwarf a bucket: gathering one whole would show
MODEL = dict(arch="qwen3_moe", hidden=512, moe_intermediate=512, experts=16, layers=2, heads=8,
             kv_heads=4, dtype="bfloat16")

RANK = textwrap.dedent("""
    import json, os, sys, requests, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from weightsync import WeightSync
    from weightsync_reference.models import fill_deterministic, tiny_moe_config

    url, out, bucket, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    modes = json.loads(sys.argv[5])            # [[mode, seed], ...]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    traffic = {"isend": 0, "irecv": 0, "collective": 0, "full_tensor": 0}

    def nbytes(t):
        return sum(x.numel() * x.element_size() for x in t) if isinstance(t, list) else t.numel() * t.element_size()

    def counting(op, key):
        def run(tensor, *a, **kw):
            traffic[key] += nbytes(tensor)
            return op(tensor, *a, **kw)
        return run
    dist.isend = counting(dist.isend, "isend")
    dist.irecv = counting(dist.irecv, "irecv")
    for name in ("all_gather", "all_gather_into_tensor", "broadcast", "all_reduce"):
        setattr(dist, name, counting(getattr(dist, name), "collective"))
    full = DTensor.full_tensor
    def counted_full(self, *a, **kw):
        traffic["full_tensor"] += 1
        return full(self, *a, **kw)
    DTensor.full_tensor = counted_full

    def build(mode, seed):
        cfg = tiny_moe_config(**spec)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        mesh = init_device_mesh("cpu", (2,))
        if mode == "fsdp2":          # every weight row-sharded: FSDP itself splits the experts
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.to_empty(device="cpu")
        else:                        # plain expert parallelism: experts split, the rest replicated
            model.to_empty(device="cpu")
            for layer in model.model.layers:
                ex = layer.mlp.experts
                for p in ("gate_up_proj", "down_proj"):
                    t = distribute_tensor(getattr(ex, p).detach(), mesh, [Shard(0)], src_data_rank=None)
                    setattr(ex, p, torch.nn.Parameter(t))
        return fill_deterministic(model, seed=seed)

    def status(key):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

    def peak(fn):
        open("/proc/self/clear_refs", "w").write("5")      # VmHWM := VmRSS
        before = status("VmRSS")
        result = fn()
        return result, status("VmHWM") - before

    cfg = {"engines": [{"url": url}], "sync": {"progress": "off"},
           "exporter": {"kind": "torch", "options": {"bucket_bytes": bucket}}}
    version = 0
    for mode, seed in modes:
        model = build(mode, seed)
        sharded = sum(t._local_tensor.nbytes for t in model.state_dict().values() if isinstance(t, DTensor))
        with WeightSync.from_config(cfg) as sync:
            version += 1
            sync.push(model, version=version)          # warm up: threads, sockets, allocator
            n, export_extra = peak(lambda: sum(len(b.tensors) for b in sync.exporter.buckets(model)))
            for k in traffic:
                traffic[k] = 0
            version += 1
            report, push_extra = peak(lambda: sync.push(model, version=version))
        if rank == 0:                                  # what the engine holds now, for the test
            r = requests.get(url + "/weights", timeout=60)
            r.raise_for_status()
            open(os.path.join(out, f"{mode}.safetensors"), "wb").write(r.content)
        print(json.dumps({"mode": mode, "rank": rank, "ok": report.ok, "verified": report.verified,
                          "version": version, "tensors": n, "own_sharded": sharded,
                          "export_extra": export_extra, "push_extra": push_extra, **traffic}))
        del model
        dist.barrier()
    dist.destroy_process_group()
""")


def _expected(seed: int, tmp: Path) -> dict[str, torch.Tensor]:
    """What save_pretrained writes for the unsharded model with the same values."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from weightsync_reference.models import fill_deterministic, tiny_moe_config
    model = AutoModelForCausalLM.from_config(tiny_moe_config(**MODEL)).to(torch.bfloat16)
    fill_deterministic(model, seed=seed).save_pretrained(tmp / f"ref{seed}")
    return {k: v for f in sorted((tmp / f"ref{seed}").glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_sharded_moe_pushed_from_the_ranks_holding_each_expert(tmp_path: Path) -> None:
    """FSDP2 (everything row-sharded) then plain expert parallelism (experts sharded, the rest
    replicated), in the same two rank processes, into one engine."""
    from safetensors.torch import load_file
    modes = [["fsdp2", 11], ["ep", 12]]
    want = {mode: _expected(seed, tmp_path) for mode, seed in modes}
    first = want["fsdp2"]
    engine_dir = write_weights_only_model(tmp_path / "engine", {k: torch.zeros_like(v) for k, v in first.items()})
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    with EngineProcess(engine_dir, log=tmp_path / "engine.log") as eng:
        procs = [subprocess.Popen([sys.executable, str(script), eng.url, str(tmp_path), str(BUCKET),
                                   json.dumps(MODEL), json.dumps(modes)], env={**env, "RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        outs = [p.communicate(timeout=600) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-4000:]
        assert eng.health()["version"] == 4
    rows = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    expert_bytes = 16 * 1024 * 512 * 2          # one fused gate_up tensor: what a gather would hold
    for mode, _ in modes:
        r0, r1 = (next(r for r in rows if r["mode"] == mode and r["rank"] == k) for k in (0, 1))
        # bit-exact: the engine holds what save_pretrained writes for these weights
        assert r0["ok"] and r0["verified"]
        got = load_file(tmp_path / f"{mode}.safetensors")
        assert set(got) == set(want[mode])
        for name, t in want[mode].items():
            assert torch.equal(got[name], t), (mode, name)
        # each row rank 1 holds (so each of its experts) travels once, to rank 0 only; nothing
        # is all-gathered
        assert r0["tensors"] == len(want[mode]) and r1["tensors"] == 0
        assert r0["full_tensor"] == r1["full_tensor"] == 0
        assert r1["irecv"] == 0 and r0["isend"] == 0
        assert r1["isend"] == r1["own_sharded"] == r0["irecv"] > 0
        assert r0["collective"] < 4096 and r1["collective"] < 4096    # plan check + report only
        # memory: no rank holds more than its own shards plus two buckets (+ a fixed allowance)
        for r in (r0, r1):
            print(f"{mode} rank {r['rank']}: sharded {r['own_sharded'] / MiB:.1f} MiB, peak extra: "
                  f"export {r['export_extra'] / MiB:.2f} MiB, push {r['push_extra'] / MiB:.2f} MiB")
            assert r["export_extra"] <= 2 * BUCKET + 2 * MiB < expert_bytes
        assert r1["push_extra"] <= 2 * BUCKET + 2 * MiB
        assert r0["push_extra"] <= 2 * BUCKET + 16 * MiB   # + the pipeline's payloads and HTTP


EDGES = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    from weightsync.exporters.torch import TorchExporter
    from weightsync_reference.models import fill_deterministic

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    calls = {"full_tensor": 0}
    full = DTensor.full_tensor
    def counted(self, *a, **kw):
        calls["full_tensor"] += 1
        return full(self, *a, **kw)
    DTensor.full_tensor = counted
    out = {"rank": rank}

    def export(model, **kw):
        ex = TorchExporter(TorchExporter.Options(bucket_bytes=kw.pop("bucket", 2048), **kw))
        return {n: t.clone() for b in ex.buckets(model) for n, t in b.tensors}

    # 1. a conversion that concatenates (hrm_text) over FSDP2 shards: whole sources come to rank 0
    cfg = AutoConfig.for_model("hrm_text", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    with torch.device("meta"):
        sharded = AutoModelForCausalLM.from_config(cfg)
    fully_shard(sharded, mesh=mesh)
    sharded.to_empty(device="cpu")
    fill_deterministic(sharded, seed=5)
    got = export(sharded)
    if rank == 0:
        ref = export(fill_deterministic(AutoModelForCausalLM.from_config(cfg), seed=5))
        out["concat"] = sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
    else:
        out["concat"] = got == {}

    # 2. layouts the row gather does not take (Shard(1)) fall back to full_tensor; every_rank
    g = torch.Generator().manual_seed(0)
    a, b, c = torch.randn(6, 4, generator=g), torch.randn(5, 3, generator=g), torch.randn(3, generator=g)
    sd = {"a": distribute_tensor(a, mesh, [Shard(1)]), "b": distribute_tensor(b, mesh, [Shard(0)]),
          "r": distribute_tensor(c.clone(), mesh, [Replicate()]), "c": c}
    calls["full_tensor"] = 0
    got = export(sd, bucket=40)
    out["fallback_calls"] = calls["full_tensor"]
    want = {"a": a, "b": b, "r": c, "c": c}
    out["fallback"] = (sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
                       if rank == 0 else got == {})
    got = export(sd, bucket=40, every_rank=True)
    out["every_rank"] = sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)

    # 3. rank 0 abandons the export after one bucket: rank 1 still finishes, and the next export
    #    starts clean
    it = TorchExporter(TorchExporter.Options(bucket_bytes=40)).buckets(sd)
    if rank == 0:
        next(it)
        it.close()
    else:
        out["abandoned_yield"] = sum(1 for _ in it)
    dist.barrier()
    got = export(sd, bucket=40)
    out["after_abandon"] = all(torch.equal(got[n], want[n]) for n in want) if rank == 0 else got == {}

    # 4. ranks holding different models: an error on every rank, not a hang
    other = dict(sd, extra=torch.zeros(2)) if rank == 1 else sd
    try:
        export(other)
        out["disagree"] = "no error"
    except ValueError as e:
        out["disagree"] = str(e)
    print(json.dumps(out), flush=True)
    dist.barrier()          # both ranks done before either tears down the group (rank 0: its store)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_sharded_edge_cases_across_two_ranks(tmp_path: Path) -> None:
    """Concatenating conversions of sharded sources, the full_tensor fallback for other layouts,
    `every_rank`, an export abandoned by rank 0, and ranks whose models differ."""
    script = tmp_path / "edges.py"
    script.write_text(EDGES)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    r0, r1 = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    for r in (r0, r1):
        assert r["concat"] and r["fallback"] and r["every_rank"] and r["after_abandon"], r
        assert r["fallback_calls"] == 1, r          # only the Shard(1) tensor was all-gathered
        assert r["disagree"].startswith("ranks [1] planned a different export than rank 0"), r
    assert r1["abandoned_yield"] == 0
