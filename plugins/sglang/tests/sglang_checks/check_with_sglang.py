"""Runs in a fresh interpreter with SGLang 0.5.23's own code on PYTHONPATH (installed with
--no-deps into <venv>/sglang-ref by the test setup). Reads a job (JSON) from argv[1],
checks our bodies and payloads with SGLang's code, prints a JSON result.

What is SGLang's own code here, and what cannot be imported without CUDA-era dependencies:
- imported as is: sglang.srt.utils.common (MultiprocessingSerializer, SafeUnpickler),
  sglang.srt.weight_sync.tensor_bucket (FlattenedTensorBucket, FlattenedTensorMetadata),
  sglang.srt.utils.msgspec_utils (the msgspec -> pydantic schema FastAPI validates bodies with);
- NOT importable here: sglang.srt.managers.io_struct and ...model_runner_components.weight_updater
  (and the FastAPI app, srt/entrypoints/http_server.py): their import chain reaches
  srt/multimodal (torchvision.transforms), and no torchvision wheel loads against
  torch 2.13.0+cpu. So their classes and functions are compiled from SGLang's own source file
  (ast: just those definitions, executed in a module that has what they reference) instead of
  being compared with docs/engines.md.
"""

from __future__ import annotations

import ast
import json
import sys
import types
import typing
from pathlib import Path

sys.modules["torchcodec"] = None  # type: ignore[assignment]  # a CUDA-only build may sit in .venv

import msgspec
import sglang
import torch
from pydantic import TypeAdapter
from safetensors.torch import load_file
from sglang.srt.utils.common import MultiprocessingSerializer
from sglang.srt.utils.msgspec_utils import Base64Bytes, msgspec_struct_pydantic_core_schema
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

SRC = Path(sglang.__file__).parent / "srt"
REQUEST_CLASSES = ["BaseReq", "UpdateWeightFromDiskReqInput", "UpdateWeightsFromDistributedReqInput",
                   "UpdateWeightsFromTensorReqInput", "InitWeightsUpdateGroupReqInput",
                   "DestroyWeightsUpdateGroupReqInput", "UpdateWeightVersionReqInput",
                   "PauseGenerationReqInput", "ContinueGenerationReqInput", "FlushCacheReqInput",
                   "GetWeightsByNameReqInput"]


def compile_from_source(path: Path, names: list[str], module_name: str, env: dict) -> types.ModuleType:
    """Only the named top-level definitions of an SGLang source file, in a module holding `env`."""
    src = path.read_text()
    tree = ast.parse(src)
    found = {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in names}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):   # methods, as plain functions
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name in names and fn.name not in found:
                found[fn.name] = fn
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"{path} no longer defines {missing}")
    mod = types.ModuleType(module_name)
    mod.__dict__.update(env)
    sys.modules[module_name] = mod
    code = compile(ast.Module(body=[found[n] for n in names], type_ignores=[]), str(path), "exec",
                   flags=__import__("__future__").annotations.compiler_flag, dont_inherit=True)
    exec(code, mod.__dict__)  # noqa: S102 - SGLang's own source, from the pinned wheel
    return mod


def io_struct() -> types.ModuleType:
    env = {n: getattr(typing, n) for n in ("Any", "Dict", "List", "Literal", "Optional", "Union",
                                           "Annotated", "Tuple")}
    env.update(msgspec=msgspec, Base64Bytes=Base64Bytes,
               msgspec_struct_pydantic_core_schema=msgspec_struct_pydantic_core_schema)
    return compile_from_source(SRC / "managers" / "io_struct.py", REQUEST_CLASSES,
                               "sglang_io_struct_from_source", env)


def fields_of(cls: type) -> dict:
    out = {}
    for f in msgspec.structs.fields(cls):
        if f.name in ("rid", "http_worker_ipc"):
            continue
        out[f.name] = "REQUIRED" if f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT \
            else f.default
    return out


def check_bodies(mod: types.ModuleType, bodies: dict) -> dict:
    """FastAPI's path: the JSON body validated into SGLang's msgspec struct via pydantic."""
    out = {}
    for cls_name, body in bodies.items():
        cls = getattr(mod, cls_name)
        obj = TypeAdapter(cls).validate_json(json.dumps(body))
        parsed = {f.name: getattr(obj, f.name) for f in msgspec.structs.fields(cls)}
        parsed = {k: (v.decode("latin-1") if isinstance(v, bytes) else v) for k, v in parsed.items()
                  if k not in ("serialized_named_tensors",)}
        out[cls_name] = {"parsed": parsed, "type": type(obj).__name__,
                         "unknown_keys": sorted(set(body) - {f.name for f in msgspec.structs.fields(cls)})}
        if cls_name == "UpdateWeightsFromTensorReqInput":
            out[cls_name]["entries_are_pickles"] = [
                isinstance(b, bytes) and b[:1] == b"\x80" for b in obj.serialized_named_tensors]
    return out


def check_tensor_entries(mod_updater: types.ModuleType, entries: list[str], expected: dict) -> dict:
    """Each TP rank's entry: SGLang's deserializer (SafeUnpickler), then SGLang's own
    _update_weights_from_flattened_bucket with a model whose load_weights records what it got."""
    results = []
    for entry in entries:
        payload = MultiprocessingSerializer.deserialize(entry)
        loaded: list = []

        model = types.SimpleNamespace(load_weights=loaded.extend)
        runner = types.SimpleNamespace(get_model=lambda m=model: m)
        ok, msg = mod_updater._update_weights_from_flattened_bucket(runner, payload)
        meta_types = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in payload["metadata"]})
        bad = [n for n, t in loaded if not (n in expected and t.dtype == expected[n].dtype
                                            and torch.equal(t, expected[n]))]
        results.append({"ok": ok, "message": msg, "names": [n for n, _ in loaded], "mismatched": bad,
                        "metadata_classes": meta_types,
                        "flattened_dtype": str(payload["flattened_tensor"].dtype)})
    return {"ranks": results}


def check_layout(flat_path: str, names_in_wire_order: list[str], expected: dict, dist_body: dict) -> dict:
    """Our data section == FlattenedTensorBucket(named_tensors) of SGLang, and what
    FlattenedTensorBucket.empty allocates for our distributed body receives it exactly."""
    ours = torch.frombuffer(bytearray(Path(flat_path).read_bytes()), dtype=torch.uint8)
    ref = FlattenedTensorBucket(named_tensors=[(n, expected[n]) for n in names_in_wire_order])
    same_bytes = torch.equal(ref.flattened_tensor, ours)
    empty = FlattenedTensorBucket.empty(dist_body["names"], dist_body["dtypes"], dist_body["shapes"], "cpu")
    recv = empty.get_flattened_tensor()
    sizes_match = recv.numel() == ours.numel()
    if sizes_match:
        recv.copy_(ours)     # what the broadcast does
    rebuilt = empty.reconstruct_tensors() if sizes_match else []
    bad = [n for n, t in rebuilt if not (t.dtype == expected[n].dtype and torch.equal(t, expected[n]))]
    return {"same_bytes_as_sglang_bucket": same_bytes, "empty_bucket_bytes": recv.numel(),
            "our_bytes": ours.numel(), "rebuilt": [n for n, _ in rebuilt], "mismatched": bad,
            "supports_multi_dtypes": FlattenedTensorBucket.supports_multi_dtypes,
            "metadata_matches": [(m.name, m.start_idx, m.end_idx, m.numel) for m in empty.metadata]
            == [(m.name, m.start_idx, m.end_idx, m.numel) for m in ref.metadata]}


def check_blocked(entry: str) -> dict:
    try:
        MultiprocessingSerializer.deserialize(entry)
    except Exception as e:  # noqa: BLE001
        return {"blocked": True, "error": f"{type(e).__name__}: {e}"}
    return {"blocked": False}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    out: dict = {"sglang_version": getattr(sglang, "__version__", None), "torch": torch.__version__}
    mod = io_struct()
    out["schemas"] = {c: fields_of(getattr(mod, c)) for c in REQUEST_CLASSES if c != "BaseReq"}
    out["bodies"] = check_bodies(mod, job["bodies"])
    expected = load_file(job["expected"])
    env = {"FlattenedTensorBucket": FlattenedTensorBucket, "FlattenedTensorMetadata": FlattenedTensorMetadata,
           "WeightUpdater": object, "torch": torch}
    updater = compile_from_source(SRC / "model_executor" / "model_runner_components" / "weight_updater.py",
                                  ["_update_weights_from_flattened_bucket"], "sglang_weight_updater_from_source", env)
    out["tensor"] = check_tensor_entries(updater, job["tensor_entries"], expected)
    out["layout"] = check_layout(job["flat_bytes"], job["wire_order"], expected, job["bodies"]["UpdateWeightsFromDistributedReqInput"])
    out["blocked"] = check_blocked(job["forbidden_entry"])
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
