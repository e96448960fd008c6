"""Fixtures for the Megatron push tests: tiny HF models saved by transformers (the checkpoints the
engines must end up holding), reference engines, and a launcher for 4 real gloo rank processes that
runs every layout in one process group (each start costs ~20 s of imports per rank on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

RANKS = Path(__file__).with_name("megatron_ranks.py")
IDS = [[3, 17, 42, 99, 5, 64, 7, 118, 23, 1, 77, 50], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 119, 100]]
VOCAB = 120          # Megatron pads it to 128 (TP 1) or 128 (TP 2): the padding must not be sent
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6)


def hf_config(arch: str, **sizes: Any) -> Any:
    """A tiny config: dense ones 4 layers (Qwen3 with tied embeddings), Qwen3-MoE 2 layers of 8
    experts, top 2. `sizes` override SMALL's (vLLM's CPU attention wants a head size of 32 or
    more)."""
    import transformers as tr
    small = {**SMALL, **sizes}
    if arch == "llama":
        return tr.LlamaConfig(num_hidden_layers=4, tie_word_embeddings=False, **small)
    if arch == "qwen2":
        return tr.Qwen2Config(num_hidden_layers=4, tie_word_embeddings=False, **small)
    if arch == "qwen3":
        return tr.Qwen3Config(num_hidden_layers=4, tie_word_embeddings=True, **small)
    if arch == "qwen3_moe":
        return tr.Qwen3MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
                                 norm_topk_prob=True, tie_word_embeddings=False, **small)
    raise ValueError(arch)


def save_hf(arch: str, path: Path, seed: int, **sizes: Any) -> Path:
    """A randomly filled model (norms too, so a swapped norm shows) saved by save_pretrained, fp32."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **sizes)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def launch(spec: dict[str, Any], tmp: Path, timeout: float = 400) -> list[dict[str, Any]]:
    """Run the 4 rank processes on `spec` and return their JSON lines; every process is gone when
    this returns, whatever happened."""
    from weightsync.net.server import free_port
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "4", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    logs = [open(tmp / f"rank{r}.log", "w+") for r in range(4)]
    procs = [subprocess.Popen([sys.executable, str(RANKS), str(tmp / "spec.json")],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=logs[r], text=True) for r in range(4)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    errors = []
    for r, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        if p.returncode != 0:
            errors.append(f"rank {r} exited {p.returncode}:\n{log.read()[-3000:]}")
        log.close()
    assert not errors, "\n".join(errors)
    return [json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")]


def problems(pushed: Path, hf_dir: Path, logits: Path, ids: torch.Tensor) -> list[str]:
    """What is wrong with an engine's weights (`pushed`, as GET /weights returns them): names and
    bytes against the HF checkpoint in `hf_dir`, and the fp32 logits of an HF model built from
    them against Megatron's own forward (`logits`), within 1e-4. Empty: all good."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    got, want = load_file(pushed), load_file(hf_dir / "model.safetensors")
    out = [f"names: {sorted(set(got) ^ set(want))}"] if set(got) != set(want) else []
    out += [f"bytes differ: {n}" for n in sorted(want) if n in got and not torch.equal(got[n], want[n])]
    built = pushed.parent / (pushed.stem + ".model")
    built.mkdir(exist_ok=True)
    shutil.copy(hf_dir / "config.json", built / "config.json")
    shutil.copy(pushed, built / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = model(input_ids=ids).logits
    mg = load_file(logits)["logits"]
    diff = float((hf_logits - mg).abs().max())
    if not diff <= 1e-4:
        out.append(f"logits differ from Megatron's by up to {diff:.2e}")
    return out


def engine_dir(hf_dir: Path, path: Path) -> Path:
    """A weights-only engine holding zeros under the checkpoint's names."""
    from safetensors.torch import load_file

    from weightsync.testing import write_weights_only_model
    return write_weights_only_model(path, {k: torch.zeros_like(v) for k, v in
                                           load_file(hf_dir / "model.safetensors").items()})


def check_traffic(rows: list[dict[str, Any]], case: str) -> None:
    """Point to point to rank 0 only: rank 0 receives exactly what the others send, no other rank
    receives anything, and the only all-gathers are the plan's exchange (a few KiB of JSON)."""
    mine = {r["rank"]: r for r in rows if r["case"] == case}
    assert set(mine) == {0, 1, 2, 3} and all(r["ok"] and r["verified"] for r in mine.values())
    assert mine[0]["send"] == 0 and all(mine[r]["recv"] == 0 for r in (1, 2, 3))
    assert mine[0]["recv"] == sum(mine[r]["send"] for r in (1, 2, 3)) > 0
    assert all(r["all_gather"] < 64 * 1024 for r in mine.values())


def check_spread(rows: list[dict[str, Any]], case: str) -> None:
    """`senders: all`: every rank verified, no tensor sent point to point (no funnel to rank 0),
    every rank sent and none more than 40% of the push's wire bytes."""
    mine = {r["rank"]: r for r in rows if r["case"] == case}
    assert set(mine) == {0, 1, 2, 3} and all(r["ok"] and r["verified"] for r in mine.values())
    assert all(r["recv"] == 0 and r["send"] == 0 for r in mine.values())
    sent = {int(k): n for k, n in mine[0]["senders"].items()}
    total = mine[0]["wire"]
    assert sum(sent.values()) == total > 0
    assert set(sent) == {0, 1, 2, 3} and min(sent.values()) > 0, sent
    assert max(sent.values()) <= 0.4 * total, {r: round(n / total, 3) for r, n in sent.items()}


DENSE = ["llama", "qwen2", "qwen3"]                       # at TP2xPP2; llama with the negative control
MOE_LAYOUTS = {"pp2_ep2": dict(tp=1, pp=2, ep=2, etp=1), "tp2_ep2_etp1": dict(tp=2, pp=1, ep=2, etp=1),
               "tp2_ep2_etp2": dict(tp=2, pp=1, ep=2, etp=2), "tp2_pp2": dict(tp=2, pp=2, ep=1, etp=1)}
MOE_NEGATIVE = "tp2_ep2_etp2"
SPREAD = {"spread_llama_tp2_pp2": ("llama", 10, dict(tp=2, pp=2, ep=1, etp=1)),
          "spread_tp2_ep2_etp2": ("qwen3_moe", 20, MOE_LAYOUTS["tp2_ep2_etp2"]),
          "spread_pp2_ep2": ("qwen3_moe", 21, MOE_LAYOUTS["pp2_ep2"])}
VPP = {"vpp_llama_tp2_pp2_vpp2": ("llama", 30, dict(tp=2, pp=2, ep=1, etp=1, vpp=2), "rank0"),
       "vpp_qwen3_tp1_pp2_vpp2": ("qwen3", 30, dict(tp=1, pp=2, ep=1, etp=1, vpp=2), "rank0"),
       "spread_llama_tp2_pp2_vpp2": ("llama", 31, dict(tp=2, pp=2, ep=1, etp=1, vpp=2), "all")}


@pytest.fixture(scope="session")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Every case in one launch of 4 ranks (one process-group start: its ~20 s of imports per rank
    are paid once): the dense models at TP2xPP2 into one engine each, then Qwen3-MoE in four
    layouts into one engine, a version per push; then `senders: all`, then virtual pipeline stages
    (VPP), above the earlier versions of their engines. Returns the directory with each case's
    logits and engine weights, and the ranks' JSON lines."""
    from weightsync_reference.processes import EngineProcess, start_all
    tmp = tmp_path_factory.mktemp("megatron")
    hf = {a: save_hf(a, tmp / f"{a}-hf", seed=i + 1) for i, a in enumerate([*DENSE, "qwen3_moe"])}
    engines = {a: EngineProcess(engine_dir(hf[a], tmp / f"{a}-engine"), log=tmp / f"{a}-engine.log")
               for a in hf}
    start_all(list(engines.values()))
    try:
        cases = [dict(name=a, hf=str(hf[a]), url=engines[a].url, version=1, negative=a == "llama",
                      tp=2, pp=2, ep=1, etp=1) for a in DENSE]
        # Qwen3 (q/k norms) exported as Llama: refused on every rank, the engine stays at v1
        cases.append(dict(name="refused", hf=str(hf["qwen3"]), url=engines["qwen3"].url, version=2,
                          refused=True, options={"architecture": "llama"}, tp=2, pp=2, ep=1, etp=1))
        version = 1
        for name, layout in MOE_LAYOUTS.items():
            cases.append(dict(name=name, hf=str(hf["qwen3_moe"]), url=engines["qwen3_moe"].url,
                              version=version, negative=name == MOE_NEGATIVE, **layout))
            version += 2 if name == MOE_NEGATIVE else 1
        for name, (arch, version, layout) in SPREAD.items():   # every rank sends its own part
            cases.append(dict(name=name, hf=str(hf[arch]), url=engines[arch].url, version=version,
                              senders="all", **layout))
        for name, (arch, version, layout, senders) in VPP.items():   # 2 chunks per stage
            cases.append(dict(name=name, hf=str(hf[arch]), url=engines[arch].url, version=version,
                              senders=senders, **layout))
        rows = launch({"out": str(tmp), "ids": IDS, "cases": cases}, tmp)
    finally:
        for e in engines.values():
            e.stop()
    return tmp, rows


class Kit:
    """The helpers above, for test modules (under --import-mode=importlib a test module cannot
    import this file: it takes them from the `kit` fixture)."""

    IDS = IDS
    save_hf = staticmethod(save_hf)
    launch = staticmethod(launch)
    problems = staticmethod(problems)
    engine_dir = staticmethod(engine_dir)
    check_traffic = staticmethod(check_traffic)
    check_spread = staticmethod(check_spread)


@pytest.fixture(scope="session")
def kit() -> type[Kit]:
    return Kit
