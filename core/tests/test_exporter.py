import os
import subprocess
import sys
import textwrap

import pytest
import torch

from weightsync.exporters.torch import TorchExporter, split_fused
from weightsync.testing import write_weights_only_model
from weightsync_reference.processes import EngineProcess


def export(model, bucket_bytes=1024, **kw):
    opts = {k: v for k, v in kw.items() if k in ("rename", "skip", "include_buffers")}
    name_map = kw.get("name_map")
    return list(TorchExporter(TorchExporter.Options(bucket_bytes=bucket_bytes, **opts))
                .buckets(model, name_map=name_map))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.qkv = torch.nn.Linear(4, 12, bias=False)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight          # tied
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


def test_module_state_dict_and_iterator_agree():
    m = Tiny()
    names = lambda bs: [n for b in bs for n in b.names]  # noqa: E731
    from_module = names(export(m))
    from_dict = names(export({k: v for k, v in m.state_dict().items() if k != "head.weight"}))
    from_iter = names(export(iter([(k, v) for k, v in m.state_dict().items() if k != "head.weight"])))
    assert from_module == from_dict == from_iter
    assert sorted(from_module) == ["embed.weight", "qkv.weight", "scale"]


def test_tied_weights_exported_once_under_first_name():
    buckets = export(Tiny())
    names = [n for b in buckets for n in b.names]
    assert "head.weight" not in names and names.count("embed.weight") == 1


def test_non_persistent_buffers_skipped_and_buffers_optional():
    assert "cache" not in [n for b in export(Tiny()) for n in b.names]
    assert "scale" not in [n for b in export(Tiny(), include_buffers=False) for n in b.names]


def test_oversized_tensor_travels_alone():
    sd = {"a": torch.zeros(10), "big": torch.zeros(1000), "b": torch.zeros(10)}
    buckets = export(sd, bucket_bytes=100)
    assert [b.names for b in buckets] == [["a"], ["big"], ["b"]]
    assert [b.last for b in buckets] == [False, False, True]


def test_rename_skip_and_split_fused():
    m = Tiny()

    def name_map(name, t):
        if name == "qkv.weight":
            return split_fused(t, ["q.weight", "k.weight", "v.weight"], [4, 4, 4])
        return [(name, t)]

    buckets = export(m, rename=[(r"^embed\.", "model.embed_tokens.")], skip=[r"^scale$"],
                     name_map=name_map)
    named = dict(t for b in buckets for t in b.tensors)
    assert sorted(named) == ["k.weight", "model.embed_tokens.weight", "q.weight", "v.weight"]
    assert torch.equal(named["k.weight"], m.qkv.weight[4:8])


def test_duplicate_mapped_name_is_an_error():
    with pytest.raises(ValueError, match="two tensors map to the name 'x'"):
        export({"a": torch.zeros(1), "b": torch.zeros(1)}, name_map=lambda n, t: [("x", t)])


def test_buckets_reference_model_tensors_without_copying():
    sd = {"w": torch.randn(64)}
    (b,) = export(sd)
    assert b.tensors[0][1].data_ptr() == sd["w"].data_ptr()


DTENSOR_SCRIPT = textwrap.dedent("""
    import os, sys, json, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from weightsync import WeightSync
    from weightsync.exporters.torch import TorchExporter
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kinds = {type(v).__name__ for v in model.state_dict().values()}
    assert kinds == {"DTensor"}, kinds
    got = {n: t for b in TorchExporter(TorchExporter.Options(bucket_bytes=600, every_rank=True)).buckets(model)
           for n, t in b.tensors}
    assert set(got) == set(full), (set(got), set(full))
    for n in full:
        assert torch.equal(got[n], full[n]), n
    sync = WeightSync.from_config({"engines": [{"url": sys.argv[1]}],
                                   "exporter": {"kind": "torch", "options": {"bucket_bytes": 600}}})
    report = sync.push(model, version=1)
    print(json.dumps({"rank": rank, "ok": report.ok, "verified": report.verified,
                      "buckets": report.buckets}))
    dist.destroy_process_group()
""")


def test_dtensor_fsdp2_shards_gathered_across_gloo_processes(tmp_path):
    """Two real ranks under FSDP2 on gloo: the exporter gathers shards into full tensors and rank
    0 pushes them (rank 1 joins the gathers but sends nothing)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    script = tmp_path / "fsdp.py"
    script.write_text(DTENSOR_SCRIPT)
    from weightsync.net.server import free_port
    with EngineProcess(write_weights_only_model(tmp_path / "m", {k: torch.zeros_like(v) for k, v in full.items()})) as eng:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, str(script), eng.url],
                                  env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                       "RANK": str(r), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
        assert '"rank": 0, "ok": true, "verified": true' in outs[0][0]
        got = eng.weights()
        assert eng.health()["version"] == 1
        for n, t in full.items():
            assert torch.equal(got[n], t), n


MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from weightsync import WeightSync
    MiB = 2**20
    bucket = int(sys.argv[2]) * MiB
    cfg = {"engines": [{"url": sys.argv[1]}], "sync": {"progress": "off"},
           "exporter": {"kind": "torch", "options": {"bucket_bytes": bucket}}}
    sync = WeightSync.from_config(cfg)
    small = {f"s{i}": torch.zeros(1024) for i in range(8)}
    sync.push(small, version=1)                    # warm up imports, sessions, threads
    # the model: many tensors, created without transient peaks
    model = {f"w{i}": torch.full((MiB // 4,), float(i)) for i in range(int(sys.argv[3]))}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = sync.push(model, version=2)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"extra": after - before, "bucket": bucket, "ok": report.ok,
                      "model": sum(t.numel() * 4 for t in model.values())}))
""")


def test_sender_peak_extra_memory_about_two_buckets(tmp_path):
    """A 320 MiB model (20x the 16 MiB bucket) pushed over HTTP to a real engine: the sender's
    peak RSS grows by at most two buckets plus a fixed allowance for the HTTP stack."""
    n_mib, bucket_mib = 320, 16
    sd = {f"w{i}": torch.zeros(2**18) for i in range(n_mib)}
    sd.update({f"s{i}": torch.zeros(1024) for i in range(8)})
    model_dir = write_weights_only_model(tmp_path / "m", sd)
    del sd
    script = tmp_path / "mem.py"
    script.write_text(MEMORY_SCRIPT)
    with EngineProcess(model_dir) as eng:
        out = subprocess.run([sys.executable, str(script), eng.url, str(bucket_mib), str(n_mib)],
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ok"] and res["model"] >= 10 * res["bucket"]
    allowance = 16 * 2**20
    print(f"sender peak extra: {res['extra'] / 2**20:.1f} MiB")
    assert res["extra"] <= 2 * res["bucket"] + allowance, \
        f"sender peak grew by {res['extra'] / 2**20:.1f} MiB with {bucket_mib} MiB buckets"
