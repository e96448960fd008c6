"""STAND-IN FOR AN LMDEPLOY API SERVER. THIS IS NOT LMDEPLOY.

LMDeploy cannot run without CUDA, so the plugin's end-to-end tests run against this server, which
follows the LMDeploy routes of docs/engines.md exactly, and uses
LMDeploy 0.18.0's own code wherever it imports without CUDA:
  * request bodies are validated with `lmdeploy.serve.openai.protocol` (UpdateParamsRequest,
    InitWeightsUpdateGroupRequest, UpdateWeightsFromDistributedRequest,
    DestroyWeightsUpdateGroupRequest); without LMDeploy, with field-for-field copies;
  * flattened payloads are rebuilt with `lmdeploy.utils.FlattenedTensorBucket`, groups are joined
    with `lmdeploy.utils.init_custom_process_group` (TCPStore + PrefixStore(group_name), rank
    `rank_offset + tp_rank`, trainer = rank 0) and received with
    `dist.broadcast(buf, src=0, group=pg)` into a buffer of the common dtype;
  * payloads are decoded as LMDeploy decodes them: base64, plain `ForkingPickler.loads`,
    `func(*args)` and `.clone()` per (rebuild_fn, args) pair, `args[6]` set to the current CUDA
    device for CUDA handles.

Routes (docs/engines.md, LMDeploy): POST /generate (GenerateReqInput -> GenerateReqOutput with
made-up tokens; 400 with LMDeploy's check_request words, 503 while asleep), POST /update_weights (200, body `null`; 500 "Internal Server Error" on any
exception), /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group ({"success", "message"}, 200 or 400; 501 on backend turbomind),
/sleep?level=1|2 and /wakeup?tags=.. (empty 200), GET /is_sleeping. Every POST route requires
Content-Type: application/json. Each TP rank is its own worker process, as with LMDeploy's Ray
executor. TurboMind (--backend turbomind) takes plain payloads only, as one string, one decoder
layer (or the misc weights) per call.

Where it differs, on purpose, and why:
  * Weights loaded by a call are kept apart until the call with finished=true, which applies
    them all (LMDeploy's finished step runs the post-processing that makes them usable). Real
    LMDeploy's PyTorch backend copies every call into the live parameters at once, so a sync that
    fails part-way leaves it with a mix; the adapter therefore keeps such an engine asleep. Here,
    tests can prove that nothing of a failed sync was applied.
  * After /sleep?level=2 the weights are on `meta`; /wakeup?tags=weights gives uninitialised
    ones, and finished=true is refused while any weight was not re-sent (LMDeploy would serve
    the uninitialised memory).
  * CPU tensor handles are accepted (rebuild argument 6 is patched only for CUDA handles):
    LMDeploy takes CUDA tensors only, and this machine has no GPU.
Test-only routes live under /standin/ (weights read-back, call counters).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import multiprocessing as mp
import os
import random
import re
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lmd_real  # noqa: E402

TM_LAYER = re.compile(r"layers\.([0-9]+)\.")


# -- LMDeploy's request models (its own when importable) --------------------------------------
def request_models() -> dict[str, Any]:
    proto, _ = lmd_real.load("lmdeploy.serve.openai.protocol")
    if proto is not None:
        return {"update": proto.UpdateParamsRequest, "init": proto.InitWeightsUpdateGroupRequest,
                "dist": proto.UpdateWeightsFromDistributedRequest,
                "destroy": proto.DestroyWeightsUpdateGroupRequest,
                "generate": proto.GenerateReqInput, "generate_meta": proto.GenerateReqMetaOutput,
                "generate_out": proto.GenerateReqOutput}
    from pydantic import BaseModel, Field

    class UpdateParamsRequest(BaseModel):
        serialized_named_tensors: str | list[str] | dict
        load_format: str | None = None
        finished: bool = False

    class InitWeightsUpdateGroupRequest(BaseModel):
        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        group_name: str
        backend: str = "nccl"

    class UpdateWeightsFromDistributedRequest(BaseModel):
        names: list[str]
        dtypes: list[str]
        shapes: list[list[int]]
        group_name: str
        load_format: str | None = None
        finished: bool = False

    class DestroyWeightsUpdateGroupRequest(BaseModel):
        group_name: str

    class GenerateReqInput(BaseModel):         # the fields the stand-in reads, as LMDeploy has them
        session_id: int | None = -1
        prompt: str | None = None
        input_ids: list[int] | None = None
        return_logprob: bool | None = None
        top_logprobs_num: int | None = None
        logprob_start_len: int = Field(default=-1, ge=-1)
        max_tokens: int = 128
        stop_token_ids: list[int] | None = None
        stream: bool | None = False
        temperature: float | None = None
        ignore_eos: bool | None = False
        top_p: float | None = None
        top_k: int | None = None

    class GenerateReqMetaOutput(BaseModel):
        prompt_tokens: int | None = None
        completion_tokens: int | None = None
        finish_reason: dict[str, Any] | None = None
        output_token_logprobs: list[tuple[float, int]] | None = None
        input_token_logprobs: list[tuple[float, int]] | None = None
        output_top_logprobs: list[list[tuple[float, int]]] | None = None
        input_top_logprobs: list[list[tuple[float, int]]] | None = None
        routed_experts: list[list[list[int]]] | str | None = None

    class GenerateReqOutput(BaseModel):
        text: str
        output_ids: list[int]
        meta_info: GenerateReqMetaOutput

    return {"update": UpdateParamsRequest, "init": InitWeightsUpdateGroupRequest,
            "dist": UpdateWeightsFromDistributedRequest, "destroy": DestroyWeightsUpdateGroupRequest,
            "generate": GenerateReqInput, "generate_meta": GenerateReqMetaOutput,
            "generate_out": GenerateReqOutput}


def lmdeploy_utils() -> Any:
    """`lmdeploy.utils`, or (without LMDeploy) a module registered under that name holding
    copies of FlattenedTensorMetadata / FlattenedTensorBucket / init_custom_process_group, so
    pickles naming `lmdeploy.utils.FlattenedTensorMetadata` load as they would on LMDeploy."""
    utils, _ = lmd_real.load("lmdeploy.utils")
    if utils is not None:
        return utils
    import types
    from dataclasses import dataclass

    import torch

    @dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    class FlattenedTensorBucket:
        def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):  # noqa: ANN001
            if named_tensors is not None:
                self.metadata, idx = [], 0
                for n, t in named_tensors:
                    self.metadata.append(FlattenedTensorMetadata(n, t.shape, t.dtype, idx, idx + t.numel(), t.numel()))
                    idx += t.numel()
                self.flattened_tensor = torch.cat([t.flatten() for _, t in named_tensors])
            else:
                self.metadata, self.flattened_tensor = metadata, flattened_tensor

        def get_flattened_tensor(self):  # noqa: ANN201
            return self.flattened_tensor

        def reconstruct_tensors(self):  # noqa: ANN201
            out = []
            for m in self.metadata:
                t = self.flattened_tensor[m.start_idx:m.end_idx].reshape(m.shape)
                out.append((m.name, t if t.dtype == m.dtype else t.to(m.dtype)))
            return out

    def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1,  # noqa: ANN001, ANN202
                                  rank=-1, store=None, group_name=None, pg_options=None):
        from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                        _world, default_pg_timeout, rendezvous)
        timeout = timeout or default_pg_timeout
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                          group_name=group_name, backend_options=pg_options, timeout=timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        return pg

    mod = types.ModuleType("lmdeploy.utils")
    FlattenedTensorMetadata.__module__ = "lmdeploy.utils"
    mod.FlattenedTensorMetadata = FlattenedTensorMetadata
    mod.FlattenedTensorBucket = FlattenedTensorBucket
    mod.init_custom_process_group = init_custom_process_group
    sys.modules.setdefault("lmdeploy", types.ModuleType("lmdeploy"))
    sys.modules["lmdeploy.utils"] = mod
    return mod


# -- one TP rank (a worker process) -----------------------------------------------------------
class Rank:
    def __init__(self, rank: int, tp: int, backend: str, model: str, group_timeout: float) -> None:
        import torch
        from safetensors.torch import load_file
        self.torch = torch
        self.rank, self.tp, self.backend = rank, tp, backend
        self.utils = lmdeploy_utils()
        self.live: dict[str, Any] = load_file(model)
        self.specs = {n: (t.dtype, tuple(t.shape)) for n, t in self.live.items()}
        self.staged: dict[str, Any] = {}
        self.uninitialised: set[str] = set()
        self.ipc_tensor = None
        self.groups: dict[str, Any] = {}
        self.group_timeout = group_timeout
        self.tm_seen: set[int] = set()

    # LMDeploy: agent.update_params / turbomind.update_params
    def _construct(self, item: Any, require_clone: bool = True) -> Any:
        func, args = item
        args = list(args)
        if getattr(func, "__name__", "") == "rebuild_cuda_tensor":
            args[6] = self.torch.cuda.current_device()
        t = func(*args)
        return t.clone() if require_clone else t

    def update_params(self, req: dict[str, Any]) -> None:
        from multiprocessing.reduction import ForkingPickler
        data = req["serialized_named_tensors"]
        if self.backend == "turbomind":
            if not isinstance(data, str):
                raise TypeError("TurboMind takes serialized_named_tensors as one string")
            weights = ForkingPickler.loads(base64.b64decode(data))
            weights = {k: self._construct(v) for k, v in weights}
            self._turbomind_layer(weights)
            self._stage(list(weights.items()))
        else:
            if isinstance(data, list):
                data = data[self.rank]
            weights = ForkingPickler.loads(base64.b64decode(data))
            if req.get("load_format") == "flattened_bucket":
                metadata = weights["metadata"]
                if not metadata:
                    weights = []
                else:
                    if "flattened_tensor" in weights:
                        self.ipc_tensor = self._construct(weights["flattened_tensor"],
                                                          weights.get("require_clone", True))
                    elif self.ipc_tensor is None:
                        raise ValueError("flattened_tensor is not provided in weights and no cached ipc "
                                         "tensor is available. Please provide flattened_tensor on the "
                                         "first update_params call.")
                    bucket = self.utils.FlattenedTensorBucket(flattened_tensor=self.ipc_tensor,
                                                              metadata=metadata)
                    weights = list(bucket.reconstruct_tensors())
            else:
                weights = [(k, self._construct(v)) for k, v in weights]
            self._stage(weights)
        if req.get("finished"):
            self._finish()

    def _turbomind_layer(self, weights: dict[str, Any]) -> None:
        keys = {(int(m.group(1)) if (m := TM_LAYER.search(k)) else -1) for k in weights}
        if len(keys) != 1:
            raise ValueError(f"one call must hold one decoder layer or the misc weights, got {sorted(keys)}")
        key = keys.pop()
        if key in self.tm_seen:
            raise ValueError(f"layer {key} was already sent in this update")
        self.tm_seen.add(key)

    def _stage(self, weights: list[tuple[str, Any]]) -> None:
        for name, w in weights:
            if name not in self.specs:
                raise KeyError(f"{name} is not a parameter of this model")
            dtype, shape = self.specs[name]
            if tuple(w.shape) != shape:
                raise RuntimeError(f"{name}: the size of the loaded tensor {tuple(w.shape)} must match "
                                   f"the parameter {shape}")
            self.staged[name] = self.torch.empty(shape, dtype=dtype).copy_(w)   # param.copy_(w)

    def _finish(self) -> None:
        missing = sorted(self.uninitialised - set(self.staged))
        if missing:
            raise RuntimeError(f"{len(missing)} weights were not re-sent after sleep level 2 "
                               f"(e.g. {missing[:3]}); they would stay uninitialised")
        self.live.update(self.staged)
        self.staged.clear()
        self.uninitialised.clear()
        self.ipc_tensor = None
        self.tm_seen.clear()

    # LMDeploy: agent.init_weights_update_group / update_weights_from_distributed / destroy
    def init_group(self, req: dict[str, Any]) -> tuple[bool, str]:
        name = req["group_name"]
        if not name:
            return False, "group_name cannot be empty"
        if name in self.groups:
            return False, f"group {name!r} already initialized"
        try:
            pg = self.utils.init_custom_process_group(
                backend=req["backend"], init_method=f"tcp://{req['master_address']}:{req['master_port']}",
                world_size=req["world_size"], rank=req["rank_offset"] + self.rank, group_name=name,
                timeout=datetime.timedelta(seconds=self.group_timeout))
            self.groups[name] = pg
            return True, "Succeeded to initialize weights update group."
        except Exception as e:  # noqa: BLE001
            return False, f"Failed to initialize weights update group: {e}"

    def update_from_distributed(self, req: dict[str, Any]) -> tuple[bool, str]:
        import torch.distributed as dist
        pg = self.groups.get(req["group_name"])
        if pg is None:
            return False, (f"group {req['group_name']!r} not initialized. "
                           "Call init_weights_update_group first.")
        try:
            if req["names"]:
                named = [(n, self.torch.empty(s, dtype=getattr(self.torch, d)))
                         for n, d, s in zip(req["names"], req["dtypes"], req["shapes"])]
                if req.get("load_format") == "flattened_bucket":
                    bucket = self.utils.FlattenedTensorBucket(named_tensors=named)
                    dist.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
                    weights = list(bucket.reconstruct_tensors())
                else:
                    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in named]
                    for h in handles:
                        h.wait()
                    weights = named
            else:
                weights = []
            self._stage(weights)
            if req.get("finished"):
                self._finish()
            return True, "Succeeded to update parameter online."
        except Exception as e:  # noqa: BLE001
            return False, (f"Failed to update parameter online: {e}. The model weights are partially "
                           "updated; please discard them and reload.")

    def destroy_group(self, req: dict[str, Any]) -> tuple[bool, str]:
        import torch.distributed as dist
        name = req["group_name"]
        pg = self.groups.get(name)
        if pg is None:
            return False, f"group {name!r} not initialized"
        try:
            dist.destroy_process_group(pg)
        except Exception as e:  # noqa: BLE001 - torch may refuse without a default group
            self.groups.pop(name, None)
            return True, f"Succeeded to destroy group {name!r} ({type(e).__name__} ignored)."
        self.groups.pop(name)
        return True, f"Succeeded to destroy group {name!r}."

    def sleep(self, level: int) -> None:
        self.staged.clear()
        self.ipc_tensor = None
        self.tm_seen.clear()
        if level == 2:
            self.live = {n: t.to("meta") for n, t in self.live.items()}

    def wakeup(self, tags: list[str]) -> None:
        if "weights" in tags:
            for n, t in list(self.live.items()):
                if t.device.type == "meta":
                    self.live[n] = self.torch.empty(t.shape, dtype=t.dtype)
                    self.uninitialised.add(n)

    def weights(self, _: Any = None) -> bytes:
        from safetensors.torch import save
        if self.uninitialised:
            raise RuntimeError(f"{len(self.uninitialised)} weights are uninitialised (sleep level 2 "
                               f"dropped them and no finished sync re-sent them)")
        if any(t.device.type == "meta" for t in self.live.values()):
            raise RuntimeError("the weights are on meta (sleep level 2)")
        return save({n: t.contiguous() for n, t in self.live.items()})


def worker(conn: Any, rank: int, tp: int, backend: str, model: str, group_timeout: float) -> None:
    r = Rank(rank, tp, backend, model, group_timeout)
    conn.send(("ready", None))
    while True:
        try:
            op, arg = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(r, op)(arg)))
        except BaseException as e:  # noqa: BLE001 - shipped to the server
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# -- the api server (main process) ------------------------------------------------------------
class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.models = request_models()
        ctx = mp.get_context("spawn")
        self.conns = []
        self.procs = []
        for r in range(args.tp):
            a, b = ctx.Pipe()
            p = ctx.Process(target=worker, args=(b, r, args.tp, args.backend, args.model, args.group_timeout),
                            daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        for c in self.conns:
            tag, _ = c.recv()
            assert tag == "ready"
        self.lock = threading.Lock()      # worker calls run one at a time, in arrival order
        self.sleeping_tags: set[str] = set()
        self.stats = {"update_weights": 0, "update_weights_from_distributed": 0, "finished": 0,
                      "init_group": 0, "destroy_group": 0, "sleep": 0, "wakeup": 0, "log": []}

    def on_ranks(self, op: str, arg: Any) -> list[tuple[str, Any]]:
        with self.lock:
            for c in self.conns:
                c.send((op, arg))
            return [c.recv() for c in self.conns]

    def on_ranks_ok(self, op: str, arg: Any) -> list[Any]:
        out = self.on_ranks(op, arg)
        errs = [v for tag, v in out if tag == "err"]
        if errs:
            raise RuntimeError(errs[0])
        return [v for _, v in out]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_state: Server

    def log_message(self, fmt: str, *args: Any) -> None:
        if os.environ.get("LMD_STANDIN_VERBOSE"):
            super().log_message(fmt, *args)

    # responses
    def send(self, status: int, body: bytes = b"", ctype: str | None = None) -> None:
        self.send_response(status)
        if ctype:
            self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, obj: Any) -> None:
        self.send(status, json.dumps(obj).encode(), "application/json")

    def send_error_envelope(self, status: int, message: str) -> None:
        """LMDeploy's create_error_response / protocol_error_response (OpenAI-style)."""
        self.send_json(status, {"message": message, "type": "invalid_request_error", "code": status,
                                "param": None, "object": "error"})

    def body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def authorized(self) -> bool:
        key = self.server_state.args.api_key
        if not key or urlparse(self.path).path.startswith("/standin/"):
            return True
        if self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self.send_json(401, {"error": {"message": "Please request with valid api key!", "code": 401}})
        return False

    def do_GET(self) -> None:  # noqa: N802
        if not self.authorized():
            return
        u = urlparse(self.path)
        st = self.server_state
        if u.path == "/is_sleeping":
            return self.send_json(200, {"is_sleeping": bool(st.sleeping_tags)})
        if u.path == "/standin/stats":
            return self.send_json(200, {**st.stats, "sleeping_tags": sorted(st.sleeping_tags)})
        if u.path == "/standin/weights":
            rank = int(parse_qs(u.query).get("rank", ["0"])[0])
            with st.lock:
                st.conns[rank].send(("weights", None))
                tag, v = st.conns[rank].recv()
            if tag == "err":
                return self.send_json(409, {"error": v.splitlines()[0]})
            return self.send(200, v, "application/octet-stream")
        self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        if not self.authorized():
            return
        u = urlparse(self.path)
        raw = self.body()
        media = (self.headers.get("Content-Type") or "").lower().split(";", 1)[0].strip()
        if media != "application/json":
            return self.send_error_envelope(400, "Unsupported Media Type: Only 'application/json' is allowed")
        route = {"/update_weights": self.update_weights, "/sleep": self.sleep, "/wakeup": self.wakeup,
                 "/init_weights_update_group": self.init_group,
                 "/update_weights_from_distributed": self.update_from_distributed,
                 "/destroy_weights_update_group": self.destroy_group,
                 "/generate": self.generate}.get(u.path)
        if route is None:
            return self.send_json(404, {"detail": "Not Found"})
        try:
            data = json.loads(raw) if raw else None
        except ValueError as e:
            return self.send_error_envelope(400, f"JSON decode error: {e}")
        route(parse_qs(u.query), data)

    def validate(self, kind: str, data: Any) -> dict[str, Any] | None:
        from pydantic import ValidationError
        try:
            return self.server_state.models[kind].model_validate(data).model_dump()
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            self.send_error_envelope(400, f"{loc}: {err.get('msg')}" if loc else err.get("msg"))
            return None

    def _not_pytorch(self) -> bool:
        backend = self.server_state.args.backend
        if backend != "pytorch":
            self.send_error_envelope(501, "Disaggregated weight-update endpoints require "
                                          f"backend=\"pytorch\", got {backend!r}.")
            return True
        return False

    # routes
    def update_weights(self, q: dict, data: Any) -> None:
        req = self.validate("update", data)
        if req is None:
            return
        st = self.server_state
        st.stats["update_weights"] += 1
        st.stats["log"].append({"route": "update_weights", "finished": req["finished"],
                                "load_format": req["load_format"]})
        try:
            st.on_ranks_ok("update_params", req)
        except Exception as e:  # noqa: BLE001 - FastAPI: an exception is a bare 500
            sys.stderr.write(f"update_weights failed: {e}\n")
            st.stats["log"][-1]["error"] = str(e).splitlines()[0]
            return self.send(500, b"Internal Server Error", "text/plain; charset=utf-8")
        if req["finished"]:
            st.stats["finished"] += 1
        self.send_json(200, None)

    def _group_reply(self, results: list[tuple[str, Any]]) -> None:
        msgs = []
        for tag, v in results:
            msgs.append((False, v.splitlines()[0]) if tag == "err" else tuple(v))
        ok = all(s for s, _ in msgs)
        msg = next((m for s, m in msgs if not s), msgs[0][1])
        self.send_json(200 if ok else 400, {"success": ok, "message": msg})

    def init_group(self, q: dict, data: Any) -> None:
        if self._not_pytorch():
            return
        req = self.validate("init", data)
        if req is None:
            return
        self.server_state.stats["init_group"] += 1
        self._group_reply(self.server_state.on_ranks("init_group", req))

    def update_from_distributed(self, q: dict, data: Any) -> None:
        if self._not_pytorch():
            return
        req = self.validate("dist", data)
        if req is None:
            return
        st = self.server_state
        st.stats["update_weights_from_distributed"] += 1
        st.stats["log"].append({"route": "update_weights_from_distributed", "finished": req["finished"],
                                "load_format": req["load_format"], "dtypes": sorted(set(req["dtypes"]))})
        results = st.on_ranks("update_from_distributed", req)
        if req["finished"] and all(tag == "ok" and v[0] for tag, v in results):
            st.stats["finished"] += 1
        self._group_reply(results)

    def destroy_group(self, q: dict, data: Any) -> None:
        if self._not_pytorch():
            return
        req = self.validate("destroy", data)
        if req is None:
            return
        self.server_state.stats["destroy_group"] += 1
        self._group_reply(self.server_state.on_ranks("destroy_group", req))

    def generate(self, q: dict, data: Any) -> None:
        """LMDeploy's /generate, non-streaming: GenerateReqInput in, GenerateReqOutput out, the
        checks of its check_request that apply here with its words. The tokens and logprobs are
        made up (a function of the prompt, the position and the number of completed syncs), and
        stop tokens are left out of output_ids as LMDeploy does."""
        req = self.validate("generate", data)
        if req is None:
            return
        st = self.server_state
        err = generate_error(req, st.args.logprobs_mode)
        if err:
            return self.send_error_envelope(400, err)
        if st.sleeping_tags:
            return self.send_error_envelope(503, "Engine is sleeping.")
        st.stats["generate"] = st.stats.get("generate", 0) + 1
        top_k = req["top_k"] if req["top_k"] is not None else 50     # GenerationConfig's default
        stops = set(req["stop_token_ids"] or [])
        rng = random.Random()
        ids = req["input_ids"]
        out: list[int] = []
        reason = "length"
        while len(out) < req["max_tokens"]:
            tok = (sum(ids) + 31 * st.stats["finished"] + 17 * len(out)
                   + (0 if top_k == 1 else rng.randrange(1000))) % 1000
            if tok in stops:
                reason = "stop"
                break
            out.append(tok)
        models = st.models
        meta = models["generate_meta"](
            finish_reason={"type": reason}, prompt_tokens=len(ids), completion_tokens=len(out),
            output_token_logprobs=[(standin_logprob(t), t) for t in out] if req["return_logprob"] and out else None)
        self.send_json(200, json.loads(models["generate_out"](text="", output_ids=out, meta_info=meta)
                                       .model_dump_json()))

    def sleep(self, q: dict, data: Any) -> None:
        level = q.get("level", ["1"])[0]
        try:
            level = int(level)
        except ValueError:
            return self.send_error_envelope(400, 'The "level" query parameter must be an integer.')
        if level not in (1, 2):
            return self.send_error_envelope(400, 'The "level" query parameter must be 1 or 2.')
        st = self.server_state
        st.sleeping_tags = {"weights", "kv_cache"}
        st.stats["sleep"] += 1
        st.on_ranks_ok("sleep", level)
        self.send(200)

    def wakeup(self, q: dict, data: Any) -> None:
        st = self.server_state
        tags = q.get("tags") or sorted(st.sleeping_tags)
        st.stats["wakeup"] += 1
        if any(t not in st.sleeping_tags for t in tags):   # LMDeploy: warns and does nothing
            return self.send(200)
        st.on_ranks_ok("wakeup", tags)
        st.sleeping_tags -= set(tags)
        self.send(200)


def generate_error(req: dict[str, Any], logprobs_mode: str | None) -> str:
    """The parts of LMDeploy's generate.check_request that apply to a text-free stand-in."""
    if logprobs_mode is None and req["return_logprob"]:
        return (f"return_logprob({req['return_logprob']}) requested but not enabled logprobs_mode "
                f"in engine configuration.")
    if (req["prompt"] is not None) ^ (req["input_ids"] is None):
        return "You must specify exactly one of prompt or input_ids"
    if req["input_ids"] is not None and len(req["input_ids"]) == 0:
        return "The input_ids must not be an empty list"
    if req["max_tokens"] is not None and req["max_tokens"] < 0:
        return f"The max_tokens {req['max_tokens']!r} must be non-negative."
    if req["max_tokens"] == 0:
        return f"The max_tokens {req['max_tokens']!r} must be a positive integer."
    if req["top_p"] is not None and not (0 < req["top_p"] <= 1):
        return f"The top_p {req['top_p']!r} must be in (0, 1]."
    if req["top_k"] is not None and req["top_k"] < 0:
        return f"The top_k {req['top_k']!r} cannot be a negative integer."
    if req["temperature"] is not None and not (0 <= req["temperature"] <= 2):
        return f"The temperature {req['temperature']!r} must be in [0, 2]"
    return ""


def standin_logprob(token: int) -> float:
    """A made-up raw logprob (raw_logprobs: no temperature in it), not a model's."""
    return -((token % 89) + 1) / 10.0


def main() -> None:
    ap = argparse.ArgumentParser(description="Stand-in LMDeploy api_server for tests (not LMDeploy)")
    ap.add_argument("--model", required=True, help="a .safetensors file with the model's weights")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--backend", default="pytorch", choices=["pytorch", "turbomind"])
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--group-timeout", type=float, default=60.0)
    ap.add_argument("--logprobs-mode", default=None, choices=["raw_logits", "raw_logprobs"],
                    help="LMDeploy's flag: /generate returns logprobs only with it")
    args = ap.parse_args()
    Handler.server_state = Server(args)
    httpd = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    httpd.daemon_threads = True
    print(f"lmdeploy stand-in on 127.0.0.1:{args.port} (tp={args.tp}, backend={args.backend})", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
