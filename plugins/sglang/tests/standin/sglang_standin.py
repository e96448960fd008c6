"""STAND-IN FOR AN SGLANG 0.5.23 SERVER, FOR TESTS ONLY. It is not SGLang.

SGLang cannot run without CUDA, so the sglang adapter is tested end to end against this server,
which follows the SGLang 0.5.23 routes of docs/engines.md and SGLang's own schemas
exactly: the same routes, request fields and defaults (SGLang's io_struct, unknown keys ignored),
the same responses ({"success", "message"}, HTTP 200/400; FastAPI's 422 for a malformed body),
the same rendezvous (each TP rank joins at rank_offset + tp_rank through
`init_custom_process_group`: TCPStore client of the trainer's store, PrefixStore(group_name),
`_new_process_group_helper`), the same receive (per names/dtypes/shapes, or one uint8
flattened_bucket broadcast with byte offsets and the "Unaligned received tensor" check), the same
SafeUnpickler allow-list for /update_weights_from_tensor, and SGLang's semantics: nothing is
staged (a failed update leaves the weights partially updated), updates wait for in-flight
generations unless generation is paused, pause modes abort | retract | in_place. `/generate`
takes SGLang's GenerateReqInput (one prompt or a batch, input_ids, sampling_params checked as
SGLang's SamplingParams.verify does, return_logprob) and answers SGLang's shape (output_ids,
meta_info with finish_reason, weight_version and, with return_logprob, output_token_logprobs as
[logprob, token id, text] triples); its tokens and logprobs are made-up functions of the weights,
not a model's.

As in SGLang, every TP rank is its own process (spawned workers); the model is a weights-only
safetensors directory held by rank 0 (the "model runner"), and `load_weights` fails on an unknown
name or a wrong shape. Test-only extras live under /standin/ (read weights back, inspect groups).

    python sglang_standin.py --model DIR --port P [--tp-size N] [--admin-api-key K]
                             [--group-timeout S] [--step-seconds S]
                             [--enable-deterministic-inference]
"""

from __future__ import annotations

import argparse
import base64
import binascii
import datetime
import hmac
import io
import json
import multiprocessing as mp
import pickle
import random
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch

# -- request schemas (sglang srt/managers/io_struct.py, 0.5.23) ------------------------------
REQUIRED = object()
SCHEMAS: dict[str, dict[str, tuple[Any, Any]]] = {
    "UpdateWeightFromDiskReqInput": {
        "model_path": (str, REQUIRED), "load_format": ((str, type(None)), None),
        "abort_all_requests": (bool, False), "weight_version": ((str, type(None)), None),
        "is_async": (bool, False), "torch_empty_cache": (bool, False), "keep_pause": (bool, False),
        "recapture_cuda_graph": (bool, False), "token_step": (int, 0), "flush_cache": (bool, True),
        "manifest": ((dict, type(None)), None)},
    "GetWeightsByNameReqInput": {"name": (str, REQUIRED), "truncate_size": (int, 100)},
    "UpdateWeightsFromDistributedReqInput": {
        "names": (list, REQUIRED), "dtypes": (list, REQUIRED), "shapes": (list, REQUIRED),
        "group_name": (str, "weight_update_group"), "flush_cache": (bool, True),
        "abort_all_requests": (bool, False), "weight_version": ((str, type(None)), None),
        "load_format": ((str, type(None)), None), "selector": (("target", "draft", "all"), "all"),
        "torch_empty_cache": (bool, False)},
    "UpdateWeightsFromTensorReqInput": {
        "serialized_named_tensors": (list, REQUIRED), "load_format": ((str, type(None)), None),
        "flush_cache": (bool, True), "abort_all_requests": (bool, False),
        "weight_version": ((str, type(None)), None), "selector": (("target", "draft", "all"), "all"),
        "torch_empty_cache": (bool, False)},
    "InitWeightsUpdateGroupReqInput": {
        "master_address": (str, REQUIRED), "master_port": (int, REQUIRED),
        "rank_offset": (int, REQUIRED), "world_size": (int, REQUIRED),
        "group_name": (str, "weight_update_group"), "backend": (str, "nccl")},
    "DestroyWeightsUpdateGroupReqInput": {"group_name": (str, "weight_update_group")},
    "UpdateWeightVersionReqInput": {"new_version": (str, REQUIRED), "abort_all_requests": (bool, True)},
    "PauseGenerationReqInput": {"mode": (("abort", "retract", "in_place"), "abort")},
    "ContinueGenerationReqInput": {"torch_empty_cache": (bool, True)},
}


class Invalid(Exception):
    """FastAPI answers 422 with {"detail": [...]} when a body does not fit the schema."""


def parse(schema: str, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise Invalid([{"loc": ["body"], "msg": "Input should be a valid dictionary", "type": "dict_type"}])
    out, errors = {}, []
    for name, (typ, default) in SCHEMAS[schema].items():
        if name not in body:
            if default is REQUIRED:
                errors.append({"loc": ["body", name], "msg": "Field required", "type": "missing"})
            out[name] = default
            continue
        v = body[name]
        if isinstance(typ, tuple) and all(isinstance(x, str) for x in typ):
            ok = v in typ
        elif typ is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        else:
            ok = isinstance(v, typ)
        if not ok:
            errors.append({"loc": ["body", name], "msg": f"Input should be {typ}", "type": "type_error"})
        out[name] = v
    if errors:
        raise Invalid(errors)
    return out   # unknown keys (rid, http_worker_ipc, anything else) are ignored


# -- SafeUnpickler (sglang srt/utils/common.py, 0.5.23: exact (module, name) pairs) ------------
@dataclass
class FlattenedTensorMetadata:
    """sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata (byte offsets)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_TORCH_DTYPES = [n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)]
ALLOWED = {("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float",
                                     "frozenset", "int", "list", "range", "set", "slice", "str", "tuple")}
ALLOWED |= {("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")}
ALLOWED |= {("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"), ("functools", "partial"),
            ("multiprocessing.resource_sharer", "DupFd"), ("torch", "Size"), ("torch", "device"),
            ("torch", "dtype"), ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"),
            ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
            ("torch", "UntypedStorage"), ("torch._tensor", "_rebuild_from_type_v2"),
            ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
            ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
            ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")}
ALLOWED |= {("torch", n) for n in _TORCH_DTYPES}
ALLOWED |= {("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                          "_rebuild_parameter", "_rebuild_meta_tensor_no_storage")}
ALLOWED |= {("torch.multiprocessing.reductions", n) for n in (
    "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd", "rebuild_storage_filename",
    "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child")}


def _rebuild_cuda_tensor_modified(*args: Any) -> Any:
    """sglang patch_torch: argument 6 is the GPU UUID, mapped to this process's device index."""
    from torch.multiprocessing import reductions
    dev = args[6]
    if isinstance(dev, str):
        dev = next(i for i in range(torch.cuda.device_count())
                   if str(torch.cuda.get_device_properties(i).uuid) == dev)
    return reductions.rebuild_cuda_tensor(*args[:6], dev, *args[7:])


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name})")
        if (module, name) == ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"):
            return FlattenedTensorMetadata
        if (module, name) == ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"):
            return _rebuild_cuda_tensor_modified
        return super().find_class(module, name)


def deserialize(data: str) -> Any:
    """MultiprocessingSerializer.deserialize: base64 (validate=True) then SafeUnpickler."""
    return SafeUnpickler(io.BytesIO(base64.b64decode(data, validate=True))).load()


# -- TP rank workers (SGLang's scheduler/model-runner processes) ----------------------------
def _empty_bucket(names: list, dtypes: list, shapes: list) -> tuple[torch.Tensor, list]:
    """FlattenedTensorBucket.empty: byte offsets, the unaligned and empty checks."""
    metadata, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype)
        shape = torch.Size(shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = shape.numel() * dtype.itemsize
        metadata.append(FlattenedTensorMetadata(name, shape, dtype, offset, offset + size, size))
        offset += size
    if not metadata:
        raise ValueError("Cannot create empty tensor bucket")
    return torch.empty(offset, dtype=torch.uint8), metadata


def _reconstruct(flat: torch.Tensor, metadata: list) -> list[tuple[str, torch.Tensor]]:
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]


def _init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                               group_name: str, timeout: datetime.timedelta) -> Any:
    """sglang.srt.utils.common.init_custom_process_group (after OpenRLHF), store path."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import (
        Backend,
        _new_process_group_helper,
        _world,
        rendezvous,
    )
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _plain(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int], bytes]]:
    return [(n, str(t.dtype).removeprefix("torch."), list(t.shape),
             t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            for n, t in named]


def worker_main(tp_rank: int, conn: Any, group_timeout: float) -> None:
    """One TP rank: joins groups, receives broadcasts, decodes its tensor-update entry."""
    import torch.distributed as dist
    groups: dict[str, Any] = {}
    timeout = datetime.timedelta(seconds=group_timeout)
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "init":
                addr, port, rank_offset, world, name, backend = args
                rank = rank_offset + tp_rank
                try:
                    groups[name] = _init_custom_process_group(backend, f"tcp://{addr}:{port}", world,
                                                              rank, name, timeout)
                    conn.send((True, "Succeeded to initialize custom process group."))
                except Exception as e:  # noqa: BLE001 - SGLang's message
                    conn.send((False, f"Failed to initialize custom process group: {e}."))
            elif cmd == "groups":
                conn.send((True, sorted(groups)))
            elif cmd == "destroy":
                (name,) = args
                if name in groups:
                    pg = groups.pop(name)
                    threading.Thread(target=dist.destroy_process_group, args=(pg,), daemon=True).start()
                    conn.send((True, "Succeeded to destroy custom process group."))
                else:
                    conn.send((False, "The group to be destroyed does not exist."))
            elif cmd == "recv":
                name, names, dtypes, shapes, load_format = args
                assert name in groups, (f"Group {name} not in {list(groups)}. "
                                        "Please call `init_weights_update_group` first.")
                if load_format == "flattened_bucket":
                    flat, metadata = _empty_bucket(names, dtypes, shapes)
                    dist.broadcast(flat, src=0, group=groups[name])
                    named = _reconstruct(flat, metadata)
                else:
                    named, handles = [], []
                    for n, d, s in zip(names, dtypes, shapes):
                        w = torch.empty(s, dtype=getattr(torch, d))
                        handles.append(dist.broadcast(w, src=0, group=groups[name], async_op=True))
                        named.append((n, w))
                    for h in handles:
                        h.wait()
                conn.send((True, _plain(named)))
            elif cmd == "decode":
                entry, load_format = args
                obj = deserialize(entry)
                if load_format == "flattened_bucket":
                    named = _reconstruct(obj["flattened_tensor"], [
                        FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)
                        for m in obj["metadata"]])
                elif load_format in (None, "direct"):
                    named = list(obj)
                else:
                    raise NotImplementedError(f"Unknown load_format={load_format}")
                conn.send((True, _plain(named)))
            else:
                conn.send((False, f"unknown worker command {cmd}"))
        except Exception as e:  # noqa: BLE001 - the main process turns it into SGLang's answer
            conn.send((False, f"{type(e).__name__}: {e}"))


def _tensors(plain: list[tuple[str, str, list[int], bytes]]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for n, d, s, raw in plain:
        dt = getattr(torch, d)
        t = torch.frombuffer(bytearray(raw), dtype=dt).reshape(s) if raw else torch.empty(s, dtype=dt)
        out.append((n, t))
    return out


# -- the server ------------------------------------------------------------------------------
class Aborted(Exception):
    pass


class Server:
    def __init__(self, model: Path, tp_size: int, group_timeout: float, step_seconds: float,
                 deterministic: bool = False) -> None:
        from safetensors.torch import load_file
        self.deterministic = deterministic
        self.model_path = str(model)
        self.tensors: dict[str, torch.Tensor] = {}
        for f in sorted(model.glob("*.safetensors")):
            self.tensors.update(load_file(f))
        self.weight_version = "default"
        self.step_seconds = step_seconds
        self.paused: str | None = None
        self.cond = threading.Condition()
        self.running: dict[str, dict[str, Any]] = {}     # rid -> request state
        self.updating = 0
        self.groups: set[str] = set()
        self.update_lock = threading.Lock()              # one weight update at a time
        ctx = mp.get_context("spawn")
        self.workers = []
        for r in range(tp_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(r, child, group_timeout), daemon=True)
            p.start()
            self.workers.append((parent, p, threading.Lock()))
        self.counters = {"flushes": 0, "updates": 0}
        self.corrupt_loads = False
        self.joining = 0
        self.all_ranks("groups", [()] * tp_size)     # serve only once every TP rank is up

    # TP fan-out: every rank runs the command; answers come back in rank order
    def all_ranks(self, cmd: str, per_rank_args: list[tuple]) -> list[tuple[bool, Any]]:
        results: list[Any] = [None] * len(self.workers)

        def run(r: int) -> None:
            conn, _, lock = self.workers[r]
            with lock:
                conn.send((cmd, per_rank_args[r]))
                results[r] = conn.recv()
        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    # model_update_lock: an update waits for in-flight generations unless generation is paused
    def writer(self) -> Any:
        server = self

        class _W:
            def __enter__(self) -> None:
                server.update_lock.acquire()
                with server.cond:
                    server.cond.wait_for(lambda: server.paused is not None or not server.running)
                    server.updating += 1

            def __exit__(self, *exc: object) -> None:
                with server.cond:
                    server.updating -= 1
                    server.cond.notify_all()
                server.update_lock.release()
        return _W()

    def abort_all(self) -> None:
        with self.cond:
            for st in self.running.values():
                st["abort"] = True
            self.cond.notify_all()

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """model.load_weights: tensor by tensor, in place; an error leaves what came before it."""
        for name, t in named:
            if name not in self.tensors:
                raise KeyError(f"{name!r} is not a parameter of this model")
            cur = self.tensors[name]
            if tuple(cur.shape) != tuple(t.shape):
                raise ValueError(f"{name}: shape {list(t.shape)} does not match the parameter's "
                                 f"{list(cur.shape)}")
            cur.copy_(t.to(cur.dtype))
            if self.corrupt_loads and cur.is_floating_point() and cur.numel():
                cur.view(-1)[0] += 1          # test-only fault: a load that lands other values
        self.counters["updates"] += 1

    def flush_cache(self) -> tuple[bool, str]:
        """Refused while requests run, unless they were retracted (their KV is recomputed)."""
        with self.cond:
            if self.running and self.paused != "retract":
                return False, "Flush cache failed: there are running requests.\n"
        self.counters["flushes"] += 1
        return True, ""

    # -- generation: a slow loop whose tokens depend on the weights ---------------------------
    def token(self) -> int:
        acc = 0
        for name in sorted(self.tensors)[:4]:
            t = self.tensors[name]
            if t.numel():
                acc = (acc * 31 + int(t.reshape(-1)[:8].float().sum().mul(1000).round().item())) % 100003
        return acc % 1000

    def generate(self, body: dict[str, Any]) -> Any:
        """GenerateReqInput: one prompt, or a batch (input_ids a list of lists, sampling_params
        a list or one dict for all); a batch answers a list, in order. Sampling params are
        checked as SGLang's SamplingParams.verify does (a ValueError: HTTP 400)."""
        ids = body.get("input_ids")
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids or []]
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * len(prompts)
        logprob = body.get("return_logprob") or False
        logprob = logprob if isinstance(logprob, list) else [logprob] * len(prompts)
        if len(sps) != len(prompts) or len(logprob) != len(prompts):
            raise ValueError("The length of sampling_params and input_ids must match")
        params = [sampling(sp) for sp in sps]
        outs = [self.generate_one(list(p or []), sp, bool(lp), body.get("rid") if not batch else None)
                for p, sp, lp in zip(prompts, params, logprob)]
        return outs if batch else outs[0]

    def generate_one(self, prompt: list[int], sp: dict[str, Any], logprob: bool,
                     rid: str | None) -> dict[str, Any]:
        n = sp["max_new_tokens"]
        rid = rid or uuid.uuid4().hex
        st = {"abort": False, "retracted": 0}
        out: list[int] = []
        versions: list[str] = []
        # SGLang draws with sampling_seed only under deterministic inference; else it is unseeded
        seed = sp.get("sampling_seed") if self.deterministic else None
        rng = random.Random(seed if seed is not None else uuid.uuid4().int)
        with self.cond:
            if self.paused == "abort":      # aborted while the update holds the lock
                return self._gen_out(rid, out, versions, "abort", st, logprob, sp)
            self.cond.wait_for(lambda: self.paused is None and not self.updating)
            self.running[rid] = st
        try:
            while len(out) < n:
                with self.cond:
                    if st["abort"]:
                        return self._gen_out(rid, out, versions, "abort", st, logprob, sp)
                    if self.paused == "retract":
                        st["retracted"] += 1     # back to the queue; KV recomputed after continue
                        self.cond.wait_for(lambda: self.paused != "retract" or st["abort"])
                        continue
                    if self.paused == "in_place":
                        self.cond.wait_for(lambda: self.paused != "in_place" or st["abort"])
                        continue
                    # greedy (top_k 1): a function of the weights and the position only
                    tok = (self.token() + 17 * len(out)
                           + (0 if sp["top_k"] == 1 else rng.randrange(1000))) % 1000
                    out.append(tok)
                    versions.append(self.weight_version)
                if tok in sp["stop_token_ids"]:
                    return self._gen_out(rid, out, versions, "stop", st, logprob, sp)
                time.sleep(self.step_seconds)
            return self._gen_out(rid, out, versions, "length", st, logprob, sp)
        finally:
            with self.cond:
                self.running.pop(rid, None)
                self.cond.notify_all()

    def _gen_out(self, rid: str, out: list[int], versions: list[str], reason: str,
                 st: dict[str, Any], logprob: bool, sp: dict[str, Any]) -> dict[str, Any]:
        finish: dict[str, Any] = {"type": reason}
        if reason == "stop":
            finish["matched"] = out[-1]
        elif reason == "length":
            finish["length"] = len(out)
        meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": 0,
                                "completion_tokens": len(out), "cached_tokens": 0,
                                "weight_version": self.weight_version,
                                "standin_token_weight_versions": versions,
                                "standin_retractions": st["retracted"]}
        if logprob:
            # SGLang: [logprob, token id, text or None] per token (text only with
            # return_text_in_logprobs); the stand-in's logprob is a made-up function of the
            # token and the temperature, not a model's
            meta["output_token_logprobs"] = [[standin_logprob(t, sp["temperature"]), t, None]
                                             for t in out]
            meta["input_token_logprobs"] = []
        return {"text": "", "output_ids": out, "meta_info": meta}


def sampling(sp: dict[str, Any]) -> dict[str, Any]:
    """SGLang's SamplingParams: its defaults, temperature 0 as top_k 1 at temperature 1, and
    verify()'s checks with SGLang's words."""
    d = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": None,
         "sampling_seed": None, "n": 1, **{k: v for k, v in sp.items() if v is not None}}
    if 0 <= d["temperature"] < 1e-6:
        d["temperature"], d["top_k"] = 1.0, 1
    if d["top_k"] == -1:
        d["top_k"] = 1 << 30
    if d["temperature"] < 0:
        raise ValueError(f"temperature must be a non-negative finite number, got {d['temperature']}.")
    if not 0.0 < d["top_p"] <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {d['top_p']}.")
    if d["top_k"] < 1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {d['top_k']}.")
    if d["max_new_tokens"] < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {d['max_new_tokens']}.")
    d["stop_token_ids"] = {int(t) for t in d["stop_token_ids"] or []}
    return d


def standin_logprob(token: int, temperature: float) -> float:
    return -((token % 97) + 1) / (10.0 * temperature)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_state: Server
    admin_key: str | None = None
    ADMIN = {"/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
             "/init_weights_update_group", "/destroy_weights_update_group", "/update_weight_version",
             "/pause_generation", "/continue_generation", "/flush_cache"}

    def log_message(self, fmt: str, *args: Any) -> None:
        pass

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise Invalid([{"loc": ["body"], "msg": "JSON decode error", "type": "json_invalid"}]) from None

    def _send(self, status: int, obj: Any, text: bool = False) -> None:
        raw = obj if isinstance(obj, bytes) else (obj.encode() if text else json.dumps(obj).encode())
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if isinstance(obj, bytes)
                         else ("text/plain" if text else "application/json"))
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        url = urlparse(self.path)
        path = url.path
        try:
            if self.admin_key and (path in self.ADMIN or path.startswith("/standin/")):
                if not hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {self.admin_key}"):
                    self._body() if method == "POST" else None
                    return self._send(401, {"error": "Unauthorized"})
            fn = ROUTES.get((method, path))
            if fn is None:
                return self._send(404, {"detail": "Not Found"})
            fn(self, self.server_state, parse_qs(url.query))
        except Invalid as e:
            self._send(422, {"detail": e.args[0]})
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            self._send(500, {"error": f"{type(e).__name__}: {e}"})

    def result(self, ok: bool, message: str, **extra: Any) -> None:
        self._send(200 if ok else 400, {"success": ok, "message": message, **extra})


ROUTES: dict[tuple[str, str], Any] = {}


def route(*keys: tuple[str, str]) -> Any:
    def deco(fn: Any) -> Any:
        for k in keys:
            ROUTES[k] = fn
        return fn
    return deco


@route(("GET", "/health"))
def _health(h: Handler, s: Server, q: dict) -> None:
    h._send(200, b"")


@route(("GET", "/model_info"))
def _model_info(h: Handler, s: Server, q: dict) -> None:
    h._send(200, {"model_path": s.model_path, "served_model_name": s.model_path,
                  "tokenizer_path": s.model_path, "is_generation": True,
                  "weight_version": s.weight_version, "load_format": "auto"})


@route(("POST", "/generate"))
def _generate(h: Handler, s: Server, q: dict) -> None:
    try:
        out = s.generate(h._body())
    except ValueError as e:        # SGLang's _create_error_response
        return h._send(400, {"error": {"message": str(e)}})
    h._send(200, out)


@route(("GET", "/get_server_info"))
def _server_info(h: Handler, s: Server, q: dict) -> None:
    """A few of SGLang's server args (the stand-in has no others) and its version."""
    h._send(200, {"model_path": s.model_path, "tp_size": len(s.workers),
                  "enable_deterministic_inference": s.deterministic,
                  "sampling_backend": "pytorch", "version": "0.5.23"})


@route(("POST", "/pause_generation"))
def _pause(h: Handler, s: Server, q: dict) -> None:
    req = parse("PauseGenerationReqInput", h._body())
    with s.cond:
        s.paused = req["mode"]
        s.cond.notify_all()
    if req["mode"] == "abort":
        s.abort_all()
    h._send(200, {"message": "Generation paused successfully.", "status": "ok"})


@route(("POST", "/continue_generation"))
def _continue(h: Handler, s: Server, q: dict) -> None:
    parse("ContinueGenerationReqInput", h._body())
    with s.cond:
        s.paused = None
        s.cond.notify_all()
    h._send(200, {"message": "Generation continued successfully.", "status": "ok"})


@route(("GET", "/flush_cache"), ("POST", "/flush_cache"))
def _flush(h: Handler, s: Server, q: dict) -> None:
    if h.command == "POST":
        h._body()
    ok, msg = s.flush_cache()
    text = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
            "or waiting requests, the operation will not be performed.)\n") if ok else msg
    h._send(200 if ok else 400, text, text=True)


def _after_update(s: Server, req: dict[str, Any]) -> str:
    suffix = ""
    if req.get("weight_version") is not None:
        s.weight_version = req["weight_version"]
        suffix = f" Weight version updated to {req['weight_version']}."
    if req.get("flush_cache"):
        s.flush_cache()
    return suffix


@route(("POST", "/update_weights_from_disk"))
def _from_disk(h: Handler, s: Server, q: dict) -> None:
    from safetensors.torch import load_file
    req = parse("UpdateWeightFromDiskReqInput", h._body())
    if req["abort_all_requests"]:
        s.abort_all()
    with s.writer():
        path = Path(req["model_path"])
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return h.result(False, f"Failed to get weights iterator: no *.safetensors in {path}.",
                            num_paused_requests=0)
        backup = {k: v.clone() for k, v in s.tensors.items()}
        try:
            for f in files:
                s.load_weights(list(load_file(f).items()))
        except Exception as e:  # noqa: BLE001 - SGLang reloads the previous path
            for k, v in backup.items():
                s.tensors[k].copy_(v)
            return h.result(False, f"Failed to update weights: {e}.\nRolling back to original weights.",
                            num_paused_requests=0)
        s.model_path = str(path)
        _after_update(s, req)
    h.result(True, "Succeeded to update model weights.", num_paused_requests=0)


@route(("POST", "/init_weights_update_group"))
def _init_group(h: Handler, s: Server, q: dict) -> None:
    req = parse("InitWeightsUpdateGroupReqInput", h._body())
    args = (req["master_address"], req["master_port"], req["rank_offset"], req["world_size"],
            req["group_name"], req["backend"])
    if req["group_name"] == "":
        return h.result(False, "Group name cannot be empty")
    with s.cond:
        s.joining += 1
    try:
        results = s.all_ranks("init", [args] * len(s.workers))
    finally:
        with s.cond:
            s.joining -= 1
    bad = [m for ok, m in results if not ok]
    if not bad:
        s.groups.add(req["group_name"])
    else:   # ranks that did join leave again (SGLang reports the first failing rank's message)
        s.all_ranks("destroy", [(req["group_name"],)] * len(s.workers))
    h.result(not bad, bad[0] if bad else results[0][1])


@route(("POST", "/destroy_weights_update_group"))
def _destroy_group(h: Handler, s: Server, q: dict) -> None:
    req = parse("DestroyWeightsUpdateGroupReqInput", h._body())
    results = s.all_ranks("destroy", [(req["group_name"],)] * len(s.workers))
    s.groups.discard(req["group_name"])
    ok = all(r[0] for r in results)
    h.result(ok, results[0][1] if ok else next(m for k, m in results if not k))


@route(("POST", "/update_weights_from_distributed"))
def _from_distributed(h: Handler, s: Server, q: dict) -> None:
    req = parse("UpdateWeightsFromDistributedReqInput", h._body())
    if req["abort_all_requests"]:
        s.abort_all()
    with s.writer():
        args = (req["group_name"], req["names"], req["dtypes"], req["shapes"], req["load_format"])
        results = s.all_ranks("recv", [args] * len(s.workers))
        bad = [m for ok, m in results if not ok]
        if bad:
            return h.result(False, f"Failed to update parameter online: {bad[0]}. The full weights "
                                   f"of the ModelRunner are partially updated. Please discard the "
                                   f"whole weights.")
        if any(r[1] != results[0][1] for r in results[1:]):
            return h.result(False, "TP ranks received different bytes")
        try:
            s.load_weights(_tensors(results[0][1]))
        except Exception as e:  # noqa: BLE001 - SGLang's load_weights_from_distributed message
            return h.result(False, f"Failed to update parameter online: {e}. The full weights of the "
                                   f"ModelRunner are partially updated. Please discard the whole weights.")
        suffix = _after_update(s, req)
    h.result(True, "Succeeded to update parameter online." + suffix)


@route(("POST", "/update_weights_from_tensor"))
def _from_tensor(h: Handler, s: Server, q: dict) -> None:
    req = parse("UpdateWeightsFromTensorReqInput", h._body())
    entries = req["serialized_named_tensors"]
    if not all(isinstance(e, str) for e in entries):
        raise Invalid([{"loc": ["body", "serialized_named_tensors"], "msg": "Input should be a valid "
                        "string", "type": "string_type"}])
    for e in entries:
        try:
            base64.b64decode(e, validate=True)
        except (binascii.Error, ValueError):
            raise Invalid([{"loc": ["body", "serialized_named_tensors"], "msg": "invalid base64",
                            "type": "value_error"}]) from None
    if len(entries) != len(s.workers):
        return h.result(False, f"serialized_named_tensors has {len(entries)} entries, the server "
                               f"has tp_size {len(s.workers)} (one per TP rank)")
    if req["abort_all_requests"]:
        s.abort_all()
    with s.writer():
        results = s.all_ranks("decode", [(entries[r], req["load_format"]) for r in range(len(s.workers))])
        bad = [m for ok, m in results if not ok]
        if bad:
            return h.result(False, bad[0])
        try:
            s.load_weights(_tensors(results[0][1]))
        except Exception as e:  # noqa: BLE001
            return h.result(False, f"{type(e).__name__}: {e}")
        suffix = _after_update(s, req)
    h.result(True, "Success" + suffix)


@route(("POST", "/update_weight_version"))
def _weight_version(h: Handler, s: Server, q: dict) -> None:
    req = parse("UpdateWeightVersionReqInput", h._body())
    if req["abort_all_requests"]:
        s.abort_all()
    s.weight_version = req["new_version"]
    h._send(200, {"success": True, "message": f"Weight version updated to {req['new_version']}",
                  "new_version": req["new_version"]})


@route(("GET", "/get_weights_by_name"), ("POST", "/get_weights_by_name"))
def _weights_by_name(h: Handler, s: Server, q: dict) -> None:
    """SGLang's read-back: the parameter's first `truncate_size` rows (dim 0) as float32 lists
    (`weight.cpu().to(torch.float32).numpy().tolist()[:truncate_size]`); a name the model does
    not have gives None there, which the route answers as 400 "Get parameter by name failed"."""
    req = parse("GetWeightsByNameReqInput", h._body())
    t = s.tensors.get(req["name"])
    if t is None or t.dim() == 0:
        return h._send(400, {"error": {"message": "Get parameter by name failed"}})
    h._send(200, t.to(torch.float32).numpy().tolist()[: req["truncate_size"]])


# -- test-only routes -------------------------------------------------------------------------
@route(("GET", "/standin/weights"))
def _weights(h: Handler, s: Server, q: dict) -> None:
    from safetensors.torch import save
    h._send(200, save({k: v.contiguous() for k, v in s.tensors.items()},
                      metadata={"weight_version": s.weight_version}))


@route(("POST", "/standin/corrupt_loads"))
def _corrupt(h: Handler, s: Server, q: dict) -> None:
    s.corrupt_loads = bool(h._body().get("on", True))
    h._send(200, {"corrupt_loads": s.corrupt_loads})


@route(("GET", "/standin/state"))
def _state(h: Handler, s: Server, q: dict) -> None:
    with s.cond:
        state = {"groups": sorted(s.groups), "paused": s.paused, "running": len(s.running),
                 "weight_version": s.weight_version, "tp_size": len(s.workers),
                 "joining": s.joining, **s.counters}
    if not state["joining"]:   # every rank's own view (a rank blocked in a join cannot answer)
        state["rank_groups"] = [g for _, g in s.all_ranks("groups", [()] * len(s.workers))]
    h._send(200, state)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--admin-api-key", default=None)
    ap.add_argument("--group-timeout", type=float, default=1800.0,
                    help="rendezvous timeout of init_weights_update_group (SGLang: torch's 30 min)")
    ap.add_argument("--step-seconds", type=float, default=0.02, help="time per generated token")
    ap.add_argument("--enable-deterministic-inference", action="store_true",
                    help="SGLang's flag: only then is a request's sampling_seed applied")
    a = ap.parse_args()
    state = Server(Path(a.model), a.tp_size, a.group_timeout, a.step_seconds,
                   a.enable_deterministic_inference)
    handler = type("H", (Handler,), {"server_state": state, "admin_key": a.admin_api_key})
    httpd = ThreadingHTTPServer((a.host, a.port), handler)
    httpd.daemon_threads = True
    print(f"SGLang stand-in serving {a.model} on http://{a.host}:{a.port} (tp_size {a.tp_size})", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
