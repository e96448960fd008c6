"""Request building and engine-side staging, checked without a server: against vLLM's own
request classes where vLLM is importable (its CPU build), else against the shapes in docs/engines.md."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from weightsync.wire.bucket import Bucket
from weightsync.encodings.raw import RawEncoding
from weightsync.errors import PayloadError
from weightsync.transports.http.sending import HttpReceiver, HttpTransport
from weightsync_vllm import native
from weightsync_vllm.adapter import VllmAdapter, _parse_version
from weightsync_vllm.bodies import render_update_weights
from weightsync_vllm.generation import VllmSampler
from weightsync_vllm.launch import VllmLauncher
from weightsync_vllm.staging import CheckpointIndex, StagedRound
from weightsync_vllm.testing import vllm_available

HAVE_VLLM, WHY_NOT = vllm_available()
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason=WHY_NOT or "vLLM is importable")


def _named() -> list[tuple[str, torch.Tensor]]:
    return [("model.embed_tokens.weight", torch.randn(16, 8).to(torch.bfloat16)),
            ("model.norm.weight", torch.ones(8)),
            ("lm_head.weight", torch.randn(16, 8).to(torch.bfloat16))]


# -- vLLM's own backends ------------------------------------------------------------------------
def test_nccl_init_info_matches_reference_doc() -> None:
    body = native.nccl_init_info(master_address="10.0.0.5", master_port=29600, rank_offset=1,
                                 world_size=3, packed=True, packed_buffer_size_bytes=1 << 30,
                                 packed_num_buffers=2)
    assert body == {"master_address": "10.0.0.5", "master_port": 29600, "rank_offset": 1,
                    "world_size": 3, "packed": True, "packed_buffer_size_bytes": 1073741824,
                    "packed_num_buffers": 2}
    uid = native.nccl_init_info(nccl_unique_id=bytes(range(128)), rank_offset=2, world_size=3)
    assert base64.b64decode(uid["nccl_unique_id_b64"]) == bytes(range(128))
    assert "master_address" not in uid
    with pytest.raises(ValueError, match="exactly one rendezvous"):
        native.nccl_init_info(rank_offset=1, world_size=2)
    with pytest.raises(ValueError, match="rank 0"):
        native.nccl_init_info(master_address="h", master_port=1, rank_offset=0, world_size=2)


def test_nccl_update_info_is_metadata_only() -> None:
    body = native.nccl_update_info(_named())
    assert body == {"names": ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
                    "dtype_names": ["bfloat16", "float32", "bfloat16"],
                    "shapes": [[16, 8], [8], [16, 8]]}
    assert json.loads(json.dumps(body)) == body


@needs_vllm
def test_native_bodies_parse_with_vllms_own_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCWeightTransferInitInfo,
        IPCWeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    init = NCCLWeightTransferInitInfo(**native.nccl_init_info(
        master_address="127.0.0.1", master_port=29600, rank_offset=1, world_size=2))
    assert init.packed and init.rank_offset == 1
    NCCLWeightTransferInitInfo(**native.nccl_init_info(nccl_unique_id=b"\1" * 128, rank_offset=1,
                                                       world_size=2))
    upd = NCCLWeightTransferUpdateInfo(**native.nccl_update_info(_named()))
    assert upd.dtype_names == ["bfloat16", "float32", "bfloat16"]
    assert IPCWeightTransferInitInfo(**native.ipc_init_info(packed=True)).packed
    # IPC over HTTP: handles go pickled; vLLM unpickles them only with the insecure flag
    handles = [{"f1e2": (1, 2)}, {"f1e2": (3, 4)}, {"f1e2": (5, 6)}]
    body = native.ipc_update_info(_named(), handles)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        IPCWeightTransferUpdateInfo(**body)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    parsed = IPCWeightTransferUpdateInfo(**body)
    assert parsed.ipc_handles == handles and parsed.names[0] == "model.embed_tokens.weight"


@needs_vllm
@pytest.mark.filterwarnings("ignore:Tensor 't:UserWarning")   # vLLM's note on oversize tensors
def test_packed_chunks_match_vllms_packer() -> None:
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors
    sizes = [300, 500, 100, 900, 50, 50, 1200, 10]
    named = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    it = iter(named)
    theirs = []
    while (chunk := pack_tensors(it, lambda x: x[1], 800)) is not None:
        theirs.append([int(n[1:]) for n in chunk.names])
    assert native.packed_chunks(sizes, 800) == theirs


def test_packed_chunks_keep_the_crossing_tensor() -> None:
    assert native.packed_chunks([5, 5, 5], 7) == [[0, 1], [2]]
    assert native.packed_chunks([10], 7) == [[0]]
    assert native.packed_chunks([], 7) == []


def test_ipc_handles_need_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        native.ipc_handles(_named())


# -- the weightsync backend's requests --------------------------------------------------------
def test_http_payload_renders_as_update_weights_json() -> None:
    bucket = Bucket(0, _named(), last=True)
    payload = RawEncoding().encode(bucket)
    parts, ctype = render_update_weights(payload.header(), payload.body)
    body = json.loads(b"".join(bytes(p) for p in parts))
    assert ctype == "application/json" and set(body) == {"update_info"}
    info = body["update_info"]
    assert info["header"] == json.loads(json.dumps(payload.header()))
    raw = base64.b64decode(info["body_b64"])
    assert raw == bytes(payload.body.numpy())
    assert isinstance(HttpReceiver(HttpTransport.Options()).receive(info["header"], memoryview(raw)),
                      torch.Tensor)


@needs_vllm
def test_backend_infos_accept_what_the_adapter_sends() -> None:
    from weightsync_vllm.backend import WeightSyncInitInfo, WeightSyncUpdateInfo
    WeightSyncInitInfo(plan={"transport": {"kind": "http"}, "encoding": {"kind": "raw"}},
                       version=3, engine_version=2)
    WeightSyncInitInfo(join={"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                             "world_size": 2, "group_name": "g", "backend": "gloo"})
    WeightSyncUpdateInfo(abort=True)
    with pytest.raises(TypeError):
        WeightSyncUpdateInfo(headers={})      # vLLM turns this into "Invalid update_info"


@needs_vllm
def test_general_plugin_registers_once() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from weightsync_vllm.vllm_plugin import register
    register()
    register()                                  # vLLM loads plugins in every process, maybe twice
    assert WeightTransferEngineFactory._registry["weightsync"]().__name__ == "WeightSyncTransferEngine"


def test_adapter_capabilities_and_version_parsing() -> None:
    """The capabilities are the methods it implements; it delivers any message (the backend
    runs weightsync's receiver), so every built-in transport assembles with it."""
    from weightsync.interfaces import (JoinsGroups, RelaysFetches, RelaysPayloads,
                                       ReloadsFromDisk, Scores, ServesPayloads)
    from weightsync.plugins import load_components
    from weightsync.sync.assembly import missing
    for cap in (ServesPayloads, RelaysFetches, JoinsGroups, ReloadsFromDisk, Scores):
        assert issubclass(VllmAdapter, cap), cap
    assert not issubclass(VllmAdapter, RelaysPayloads)     # it relays by fetch, not by frames
    assert VllmAdapter.accepts is None
    transports = load_components().transports
    for name in ("http", "shm", "collective"):
        assert missing(VllmAdapter, transports.get(name)) == [], name
    assert VllmAdapter.pause_modes == ("abort", "wait", "keep", "keep_stale_kv")
    assert _parse_version(None) == 0 and _parse_version("7") == 7 and _parse_version("step-12") == 12


# -- staging inside the worker ----------------------------------------------------------------
@pytest.fixture
def index(tmp_path: Path) -> CheckpointIndex:
    save_file(dict(_named()), str(tmp_path / "model.safetensors"))
    return CheckpointIndex(tmp_path)


def _round(index: CheckpointIndex) -> StagedRound:
    return StagedRound(index, RawEncoding(), HttpReceiver(HttpTransport.Options()), 1)


def _stage(r: StagedRound, named: list[tuple[str, torch.Tensor]], index: int = 0, last: bool = True) -> str:
    p = RawEncoding().encode(Bucket(index, named, last=last))
    return r.stage(p.header(), memoryview(p.body.numpy()))


def test_round_stages_checked_tensors(index: CheckpointIndex) -> None:
    r = _round(index)
    new = [(n, t + 1) for n, t in _named()]
    d = _stage(r, new)
    assert r.end() == {0: d}
    assert all(torch.equal(r.staged[n], t) for n, t in new)
    assert index.current("model.norm.weight").shape == (8,)      # base still the file's


@pytest.mark.parametrize("bad, words", [
    ([("model.norm.weightz", torch.ones(8))], ["model.norm.weightz", "model.norm.weight"]),
    ([("model.norm.weight", torch.ones(9))], ["model.norm.weight", "[9]", "[8]"]),
    ([("model.norm.weight", torch.ones(8, dtype=torch.float16))], ["float16", "cast"]),
])
def test_round_refuses_unknown_names_shapes_dtypes(index: CheckpointIndex, bad: list, words: list[str]) -> None:
    r = _round(index)
    with pytest.raises(PayloadError) as e:
        _stage(r, bad)
    for w in words:
        assert w in str(e.value)
    assert r.staged == {}


def test_round_detects_corruption_and_missing_buckets(index: CheckpointIndex) -> None:
    r = _round(index)
    p = RawEncoding().encode(Bucket(0, _named()[:1], last=False))
    body = bytearray(p.body.numpy().tobytes())
    body[-1] ^= 0xFF
    with pytest.raises(PayloadError, match="digest"):
        r.stage(p.header(), memoryview(body))
    _stage(r, _named()[1:], index=1, last=True)
    with pytest.raises(PayloadError, match=r"buckets \[0\] never arrived"):
        r.end()


def test_index_needs_a_local_directory(tmp_path: Path) -> None:
    with pytest.raises(PayloadError, match="local directory"):
        CheckpointIndex("org/some-hub-model")
    with pytest.raises(PayloadError, match="no \\*.safetensors"):
        CheckpointIndex(tmp_path)


# -- rollouts: request bodies against vLLM's own CompletionRequest ------------------------------
@needs_vllm
def test_completion_body_becomes_the_asked_vllm_sampling_params() -> None:
    """Every SamplingParams field reaches vLLM's own SamplingParams (nothing silently dropped),
    the sampled token's logprob is asked for, and child i of n gets seed + i."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.v1.engine.parallel_sampling import ParentRequest
    from weightsync.interfaces.sampling import SamplingParams
    from weightsync_vllm.generation import SAMPLING, completion_body

    p = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, seed=11, max_new_tokens=9,
                       stop_token_ids=[2, 4])
    req = CompletionRequest.model_validate({"model": "m", **completion_body([1, 2, 3], p)})
    sp = req.to_sampling_params(9)
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.max_tokens) == (3, 0.7, 0.9, 5, 11, 9)
    assert set(sp.stop_token_ids) == {2, 4} and sp.logprobs == 0 and req.return_token_ids
    assert req.prompt == [1, 2, 3]
    assert SAMPLING == set(SamplingParams.model_fields)
    parent = ParentRequest.__new__(ParentRequest)
    parent.sampling_params, parent.cached_child_sampling_params = sp, None
    assert [parent._get_child_sampling_params(i).seed for i in range(3)] == [11, 12, 13]
    off = CompletionRequest.model_validate({"model": "m", **completion_body([1], SamplingParams())})
    assert off.to_sampling_params(16).top_k in (0, -1) and off.seed is None


@needs_vllm
def test_score_body_asks_the_prompt_tokens_own_logprobs() -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from weightsync_vllm.generation import score_body
    sp = CompletionRequest.model_validate({"model": "m", **score_body([5, 6, 7])}).to_sampling_params(1)
    assert sp.prompt_logprobs == 0 and sp.max_tokens == 1


def test_parse_choices_refuses_missing_logprobs() -> None:
    from weightsync.errors import EngineError
    from weightsync_vllm.generation import parse_choices
    good = {"choices": [{"index": 1, "token_ids": [4], "logprobs": {"token_logprobs": [-0.5]},
                         "finish_reason": "stop"},
                        {"index": 0, "token_ids": [3, 9], "finish_reason": "length",
                         "logprobs": {"token_logprobs": [-1.0, -2.0]}}]}
    assert parse_choices("e", good, 2) == [([3, 9], [-1.0, -2.0], "length"), ([4], [-0.5], "stop")]
    bad = {"choices": [{"index": 0, "token_ids": [3, 9], "logprobs": {"token_logprobs": [-1.0]}}]}
    with pytest.raises(EngineError, match="2 tokens but logprobs"):
        parse_choices("e", bad, 1)
    with pytest.raises(EngineError, match="without token_ids or logprobs"):
        parse_choices("e", {"choices": [{"index": 0, "text": "x"}]}, 1)
    with pytest.raises(EngineError, match="1 choices for n=2"):
        parse_choices("e", bad, 2)


def test_start_command_keeps_or_makes_the_backend_token(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    options: dict = {}
    env = {"WEIGHTSYNC_API_KEY": "sk-1"}
    argv = VllmLauncher.start_command("/m", "10.0.0.2", 8123, "e1", options, env)
    assert argv[:3] == ["{python}", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--model") + 1] == "/m"
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "weightsync"}
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_API_KEY"] == "sk-1"
    assert len(options["token"]) == 32 and env["WEIGHTSYNC_VLLM_TOKEN"] == options["token"]
    kept: dict = {"token": "t0"}
    VllmLauncher.start_command("/m", "h", 1, "e", kept, env2 := {})
    assert kept["token"] == env2["WEIGHTSYNC_VLLM_TOKEN"] == "t0"


def test_start_command_without_vllm_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    from weightsync.errors import ConfigError
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="vLLM is not installed on this node"):
        VllmLauncher.start_command("/m", "h", 1, "e", {}, {})


def test_an_aborted_completion_is_not_fitting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that a pause in mode abort ended comes back partial: refused, never a sample."""
    from weightsync.config import EngineSpec
    from weightsync.interfaces.sampling import Gate, NotFitting, SamplingParams
    s = VllmSampler(VllmAdapter(engine=EngineSpec(url="http://127.0.0.1:9", name="e")))
    versions = iter([4, 5])
    monkeypatch.setattr(s, "weight_version", lambda: next(versions))
    monkeypatch.setattr(s, "_generation_call", lambda body: {"choices": [
        {"index": 0, "token_ids": [3], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "abort"}]})
    with pytest.raises(NotFitting, match="engine e aborted the request") as e:
        s.generate([1, 2], SamplingParams(max_new_tokens=4), Gate(min_version=4))
    assert e.value.held == 5
