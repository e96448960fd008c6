"""One trainer rank of the Megatron push tests (run as a process per rank, gloo, env:// rendezvous).

argv[1]: a JSON file {"out": dir, "ids": [[token ids]], "cases": [{"name", "hf", "tp", "pp", "ep",
"etp", "vpp", "url", "version", "negative", "senders"}]}. For each case, in the same process group: initialize
Megatron's parallel state, build and load the model from the HF checkpoint, run the forward
across stages (the last stage's first rank writes the logits), push it into the case's engine with
the `megatron` exporter (rank 0 then saves what the engine holds) and, with "negative", push again
with gate and up joined naively (each shard's [gate; up] concatenated, then halved) as the next
version; with "refused" (and exporter "options" naming the wrong architecture), push once and
report what each rank was told. A case with "adapter": "vllm" and "engines" (a live vLLM server
started as test_push_vllm.py does) pushes through the `vllm` adapter instead, and rank 0 reads
back with vllm_probe.read_back (the held weights, the served logits, the weight version): before
the push too when the case asks for "before". Prints one JSON line per rank and case with the
bytes each kind of communication moved during the good push and each chunk's global layer numbers."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import requests
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from weightsync_megatron.cpu import patch_for_cpu

TRAFFIC = {"send": 0, "recv": 0, "gather": 0, "all_gather": 0}


def counting(op, key):  # noqa: ANN001, ANN201
    def run(tensor, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        ts = tensor if isinstance(tensor, list) else [tensor]
        TRAFFIC[key] += sum(t.numel() * t.element_size() for t in ts)
        return op(tensor, *a, **kw)
    return run


def fetch(case: dict, out: Path, tag: str, ids: torch.Tensor) -> None:
    """What the case's engine holds now, saved as `<case>.<tag>.safetensors` (checkpoint names)."""
    if case.get("adapter") == "vllm":
        from vllm_probe import read_back           # next to this script (its folder is sys.path[0])
        vocab = json.loads((Path(case["hf"]) / "config.json").read_text())["vocab_size"]
        read_back(case["engines"][0], out / f"{case['name']}.{tag}", ids, vocab)
        return
    r = requests.get(case["url"] + "/weights", timeout=120)
    r.raise_for_status()
    (out / f"{case['name']}.{tag}.safetensors").write_bytes(r.content)


def naive_join(real):  # noqa: ANN001, ANN201
    """The negative control: a GLU weight joined as if it were a plain column-parallel one."""
    def wrong(kind, shards, geo):  # noqa: ANN001, ANN202
        if kind == "glu":
            return list(torch.cat(shards).chunk(2))
        return real(kind, shards, geo)
    return wrong


def run_case(case: dict, ids: torch.Tensor, out: Path) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from weightsync import WeightSync
    from weightsync_megatron import move
    from weightsync_megatron.testing import build_gpt, forward, load_hf

    vpp = case.get("vpp", 1)                       # > 1: a list of chunks, one per virtual stage
    ps.initialize_model_parallel(case["tp"], case["pp"], vpp if vpp > 1 else None,
                                 expert_model_parallel_size=case["ep"],
                                 expert_tensor_parallel_size=case["etp"])
    model_parallel_cuda_manual_seed(1234)
    rank = dist.get_rank()
    model = build_gpt(case["hf"], case["tp"], case["pp"], case["ep"], case["etp"], vpp)
    chunks = model if isinstance(model, list) else [model]   # the chunk list, as Megatron keeps it
    load_hf(model, case["hf"])
    logits = forward(model, ids)
    vocab = json.loads((Path(case["hf"]) / "config.json").read_text())["vocab_size"]
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and \
            ps.get_data_parallel_rank() == 0:
        save_file({"logits": logits[..., :vocab].contiguous()}, str(out / f"{case['name']}.logits.safetensors"))
    options = {"hf_config": case["hf"], "bucket_bytes": 65536, **case.get("options", {})}
    cfg = {"engines": case.get("engines") or [{"url": case["url"]}],
           # four ranks and an engine on two cores: a renewal can wait seconds for a core, and
           # the default 10 s lease lapsed once mid-push under a loaded CI run
           "sync": {"progress": "off", "senders": case.get("senders", "rank0"), "lease": 30},
           "exporter": {"kind": "megatron", "options": options}}
    if case.get("adapter"):
        cfg["adapter"] = case["adapter"]
    if case.get("before") and rank == 0:
        fetch(case, out, "before", ids)
    if case.get("refused"):                        # a model the exporter's table does not fit
        with WeightSync.from_config(cfg) as sync:
            try:
                sync.push(chunks, version=case["version"])
                said = "pushed"
            except Exception as e:  # noqa: BLE001 - what each rank was told is the result
                said = f"{type(e).__name__}: {e}"
        if rank == 0:
            fetch(case, out, "after", ids)
        print(json.dumps({"case": case["name"], "rank": rank, "refused": said}), flush=True)
        dist.barrier()
        ps.destroy_model_parallel()
        return
    if os.environ.get("MEGATRON_RANKS_DIRECT"):            # debugging: the exporter alone
        from weightsync_megatron.exporter import MegatronExporter
        ex = MegatronExporter(MegatronExporter.Options(hf_config=case["hf"]))
        print(json.dumps({"direct": [n for b in ex.buckets(model) for n, _ in b.tensors]}), flush=True)
    with WeightSync.from_config(cfg) as sync:
        for k in TRAFFIC:
            TRAFFIC[k] = 0
        report = sync.push(chunks, version=case["version"])
        moved = dict(TRAFFIC)
        if rank == 0:
            fetch(case, out, "pushed", ids)
        if case.get("negative"):
            real = move.to_hf
            move.to_hf = naive_join(real)
            try:
                sync.push(chunks, version=case["version"] + 1)
            finally:
                move.to_hf = real
            if rank == 0:
                fetch(case, out, "negative", ids)
    print(json.dumps({"case": case["name"], "rank": rank, "ok": report.ok, "verified": report.verified,
                      "senders": report.senders, "wire": report.wire_bytes, **moved,
                      "layers": [[int(x.layer_number) for x in c.decoder.layers] for c in chunks]}),
          flush=True)
    del model, chunks
    dist.barrier()
    ps.destroy_model_parallel()


def main() -> None:
    import faulthandler
    import logging
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    spec = json.loads(Path(sys.argv[1]).read_text())
    faulthandler.dump_traceback_later(spec.get("hang_s", 300), exit=True)   # a hang shows where
    dist.init_process_group("gloo")
    patch_for_cpu()
    dist.send, dist.recv = counting(dist.send, "send"), counting(dist.recv, "recv")
    dist.gather = counting(dist.gather, "gather")
    dist.all_gather = counting(dist.all_gather, "all_gather")
    torch.set_num_threads(1)
    ids = torch.tensor(spec["ids"])
    for case in spec["cases"]:
        run_case(case, ids, Path(spec["out"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
