"""The adapter's bytes and bodies checked against LMDeploy 0.18.0's own code (installed with
--no-deps by `make test`), imported without CUDA where it can be (see lmd_real.py). Modules that
cannot be imported are named, with the reason, and checked against their source text or the
LMDeploy routes of docs/engines.md instead."""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import lmd_real
from weightsync.config import EngineSpec
from weightsync.encodings.raw import RawEncoding
from weightsync.transports.collective import Broadcast, JoinGroup, LeaveGroup
from weightsync.wire.bucket import Bucket
from weightsync_lmdeploy import serialize as S
from weightsync_lmdeploy.adapter import LmdeployAdapter, LmdeployOptions
from weightsync_lmdeploy.segments import flattened_runs

utils, UTILS_WHY = lmd_real.load("lmdeploy.utils")
proto, PROTO_WHY = lmd_real.load("lmdeploy.serve.openai.protocol")
needs_utils = pytest.mark.skipif(utils is None, reason=f"cannot check against LMDeploy: {UTILS_WHY}")
needs_proto = pytest.mark.skipif(proto is None, reason=f"cannot check against LMDeploy: {PROTO_WHY}")


def sample() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [("model.layers.0.mlp.up_proj.weight", torch.randn(6, 4, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.randn(4, generator=g)),
            ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4, generator=g).to(torch.bfloat16)),
            ("model.step", torch.tensor(7)), ("model.scalar", torch.tensor(1.5)),
            ("model.empty", torch.empty(0, 3))]


def lmdeploy_decode(s: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """LMDeploy's agent.update_params decoding, minus `args[6] = cuda device` (CPU handles here)."""
    from multiprocessing.reduction import ForkingPickler
    weights = ForkingPickler.loads(base64.b64decode(s))
    if load_format == "flattened_bucket":
        func, args = weights["flattened_tensor"]
        flat = func(*args).clone()
        return list(utils.FlattenedTensorBucket(flattened_tensor=flat,
                                                metadata=weights["metadata"]).reconstruct_tensors())
    return [(k, f(*a).clone()) for k, (f, a) in weights]


@needs_utils
def test_lmdeploy_version_is_the_one_checked() -> None:
    assert lmd_real.version() == lmd_real.LMDEPLOY_VERSION


@needs_utils
def test_metadata_pickles_to_lmdeploys_exact_bytes() -> None:
    """Our dataclass pickles byte for byte as lmdeploy.utils.FlattenedTensorMetadata does."""
    from multiprocessing.reduction import ForkingPickler
    mine = S.flattened_metadata([(n, t) for n, t in sample() if t.dtype == torch.bfloat16])
    theirs = [utils.FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)
              for m in mine]
    assert S.dumps(mine) == bytes(ForkingPickler.dumps(theirs))


@needs_utils
def test_flattened_runs_decode_with_lmdeploys_bucket() -> None:
    """Every dtype run of a payload, serialized by us, rebuilt by LMDeploy's FlattenedTensorBucket."""
    named = sample()
    body = RawEncoding().encode(Bucket(0, named, last=True)).body
    runs = flattened_runs(body)
    assert len(runs) == len({t.dtype for _, t in named})
    got: dict[str, torch.Tensor] = {}
    for seg in runs:
        decoded = lmdeploy_decode(S.serialize_flattened(seg.flat, seg.metadata), "flattened_bucket")
        got.update(decoded)
    for n, t in named:
        assert got[n].dtype == t.dtype and got[n].shape == t.shape and torch.equal(got[n], t), n


@needs_utils
def test_flattened_matches_lmdeploys_own_bucket_layout() -> None:
    """Our element ranges equal those LMDeploy's FlattenedTensorBucket computes for the same run."""
    named = [(n, t) for n, t in sample() if t.dtype == torch.bfloat16]
    theirs = utils.FlattenedTensorBucket(named_tensors=named)
    mine = S.flattened_metadata(named)
    assert [(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) for m in mine] == \
        [(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) for m in theirs.get_metadata()]


@needs_utils
def test_plain_payload_equals_serialize_state_dict() -> None:
    """The plain payload decodes like LMDeploy's own serialize_state_dict output."""
    named = sample()
    ours = lmdeploy_decode(S.serialize_plain(named), None)
    theirs = lmdeploy_decode(utils.serialize_state_dict(dict(named)), None)
    assert [n for n, _ in ours] == [n for n, _ in theirs] == [n for n, _ in named]
    for (n, a), (_, b), (_, t) in zip(ours, theirs, named):
        assert torch.equal(a, b) and torch.equal(a, t) and a.dtype == t.dtype, n


# -- request bodies ----------------------------------------------------------------------------
class _Recorder(BaseHTTPRequestHandler):
    """Records every request and answers as LMDeploy does (null / empty / success JSON)."""

    protocol_version = "HTTP/1.1"
    seen: list[dict[str, Any]] = []

    def log_message(self, *a: Any) -> None:
        pass

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        path, _, query = self.path.partition("?")
        self.seen.append({"method": self.command, "path": path, "query": query,
                          "ctype": self.headers.get("Content-Type"), "auth": self.headers.get("Authorization"),
                          "body": json.loads(raw) if raw else None})
        if path == "/is_sleeping":
            out = b'{"is_sleeping": false}'
        elif path == "/update_weights":
            out = b"null"
        elif path in ("/sleep", "/wakeup"):
            out = b""
        else:
            out = b'{"success": true, "message": "ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        if out:
            self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    handler = type("H", (_Recorder,), {"seen": seen})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


def drive(url: str, **options: Any) -> LmdeployAdapter:
    """One whole round through the adapter: pause, two buckets, join/announce/leave, resume."""
    spec = EngineSpec(url=url, api_key="k3y")
    a = LmdeployAdapter(LmdeployOptions(ipc_device="cpu", **options), spec)
    a.health()
    a.pause("abort")
    a.begin(1, {"transport": {"kind": "lmdeploy_ipc"}})
    named = sample()
    for i, part in enumerate((named[:3], named[3:])):
        a.load_payload(RawEncoding().encode(Bucket(i, part, last=i == 1)))
    info = {"master_address": "127.0.0.1", "master_port": 29600, "rank_offset": 1, "world_size": 3,
            "group_name": "ws_1", "backend": "nccl"}
    a.deliver(JoinGroup(info))
    payload = RawEncoding().encode(Bucket(0, named, last=True))
    from weightsync.transports.collective import split_payload
    for tensor, dtype, specs in split_payload(payload.body, "flat_per_dtype"):
        a.deliver(Broadcast(payload.header(group_name="ws_1", layout="flat_per_dtype", dtype=dtype,
                                          nbytes=tensor.numel() * tensor.element_size(),
                                          numel=tensor.numel(), tensors=specs)))
    a.commit(1)
    a.resume()
    a.deliver(LeaveGroup(info))
    return a


@needs_proto
def test_bodies_validate_with_lmdeploys_request_models(recorder: Any) -> None:
    url, seen = recorder
    drive(url, tp_size=2)
    models = {"/update_weights": proto.UpdateParamsRequest,
              "/init_weights_update_group": proto.InitWeightsUpdateGroupRequest,
              "/update_weights_from_distributed": proto.UpdateWeightsFromDistributedRequest,
              "/destroy_weights_update_group": proto.DestroyWeightsUpdateGroupRequest}
    checked = 0
    for r in seen:
        assert r["auth"] == "Bearer k3y"
        if r["method"] != "POST":
            continue
        assert r["ctype"] == "application/json", r     # LMDeploy's validate_json_request
        model = models.get(r["path"])
        if model is None:
            assert r["path"] in ("/sleep", "/wakeup") and r["body"] == {}
            continue
        assert set(r["body"]) <= set(model.model_fields), f"{r['path']}: keys LMDeploy ignores"
        parsed = model.model_validate(r["body"]).model_dump()
        assert parsed == {**parsed, **r["body"]}
        checked += 1
    updates = [r["body"] for r in seen if r["path"] == "/update_weights"]
    assert all(isinstance(b["serialized_named_tensors"], list) and len(b["serialized_named_tensors"]) == 2
               for b in updates), "TP 2: one serialized string per rank"
    assert [b["finished"] for b in updates] == [False] * (len(updates) - 1) + [True]
    dist = [r["body"] for r in seen if r["path"] == "/update_weights_from_distributed"]
    assert [b["finished"] for b in dist] == [False] * (len(dist) - 1) + [True]
    assert all(len(set(b["dtypes"])) == 1 and b["load_format"] == "flattened_bucket" for b in dist)
    assert checked == len(updates) + len(dist) + 2


def test_sleep_and_wakeup_follow_the_documented_flow(recorder: Any) -> None:
    """Reference doc 3.3: /sleep?level=L then /wakeup?tags=weights, updates, /wakeup?tags=kv_cache,
    all with a JSON content type and `{}` body."""
    url, seen = recorder
    drive(url, sleep_level=1)
    flow = [(r["path"], r["query"]) for r in seen if r["path"] in ("/sleep", "/wakeup")]
    assert flow == [("/sleep", "level=1"), ("/wakeup", "tags=weights"), ("/wakeup", "tags=kv_cache")]
    first_update = next(i for i, r in enumerate(seen) if r["path"] == "/update_weights")
    wake_kv = next(i for i, r in enumerate(seen) if r["query"] == "tags=kv_cache")
    wake_w = next(i for i, r in enumerate(seen) if r["query"] == "tags=weights")
    assert wake_w < first_update < wake_kv


def _management_source() -> tuple[str | None, str]:
    mod, why = lmd_real.load("lmdeploy.serve.openai.endpoints.management")
    if mod is not None:
        import inspect
        return inspect.getsource(mod), "imported"
    spec = importlib.util.find_spec("lmdeploy.utils")
    if spec is None or spec.origin is None:
        return None, why
    path = Path(spec.origin).parent / "serve" / "openai" / "endpoints" / "management.py"
    return (path.read_text() if path.exists() else None), why


def test_routes_against_lmdeploys_management_module(recorder: Any) -> None:
    """Every route the adapter calls is declared by LMDeploy with that method, and every POST
    route with validate_json_request. management.py imports the engines (mmengine, CUDA), so it
    is read as source when it cannot be imported; without LMDeploy, the routes of docs/engines.md."""
    url, seen = recorder
    drive(url)
    used = {(r["method"], r["path"]) for r in seen}
    src, why = _management_source()
    if src is None:
        pytest.skip(reason=f"lmdeploy.serve.openai.endpoints.management unavailable ({why}); "
                           f"the stand-in server checks these routes against docs/engines.md")
    declared = {(m.upper(), p): deps for m, p, deps in
                re.findall(r"@router\.(get|post)\(\s*'([^']+)'\s*,?\s*(dependencies=\[[^\]]*\])?", src)}
    for method, path in used:
        assert (method, path) in declared, f"{method} {path} is not an LMDeploy route ({why})"
        if method == "POST":
            assert "validate_json_request" in declared[(method, path)], path
