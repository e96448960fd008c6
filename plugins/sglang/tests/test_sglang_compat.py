"""Checked against SGLang 0.5.23's own code (issue acceptance 3). The test setup installs
`sglang==0.5.23` with --no-deps (plus orjson, msgspec, pybase64, ipython, traitlets) into
<venv>/sglang-ref (a --target folder, not on the venv path), and runs sglang_checks/check_with_sglang.py in a fresh
interpreter that sees it. There, SGLang's own request classes validate our bodies, SGLang's own
MultiprocessingSerializer/SafeUnpickler decode our tensor payloads and SGLang's own
_update_weights_from_flattened_bucket and FlattenedTensorBucket rebuild them. io_struct.py and
weight_updater.py cannot be imported without torchvision (no wheel loads against torch
2.13.0+cpu), so the checker compiles just the needed definitions from SGLang's own source files;
the docstring of check_with_sglang.py says exactly which."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from weightsync.wire.bucket import Bucket
from weightsync.config import EngineSpec
from weightsync.encodings.raw import RawEncoding
from weightsync.testing.sample import sample_state_dict
from weightsync.transports.collective import split_payload
from weightsync_sglang.adapter import SGLangAdapter
from weightsync_sglang.layout import flat_bucket
from weightsync_sglang.pickling import serialize
from weightsync_sglang.tensor_transport import SGLangTensorTransport

HERE = Path(__file__).parent
CHECK = HERE / "sglang_checks" / "check_with_sglang.py"


def _standin_schemas() -> dict:
    spec = importlib.util.spec_from_file_location("sglang_standin_mod", HERE / "standin" / "sglang_standin.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = mod          # dataclasses look their module up
    spec.loader.exec_module(mod)
    return {cls: {f: ("REQUIRED" if d is mod.REQUIRED else d) for f, (_, d) in fields.items()}
            for cls, fields in mod.SCHEMAS.items()}


@pytest.fixture(scope="module")
def checked(sglang_runner, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sglang_compat")
    sd = sample_state_dict()
    payload = RawEncoding().encode(Bucket(3, list(sd.items()), last=True))
    a = SGLangAdapter(SGLangAdapter.Options(tp_size=2), EngineSpec(url="http://127.0.0.1:30000"))
    data, dtype, specs = split_payload(payload.body, a.layout)[0]
    header = payload.header(group_name="weightsync_1", layout="flat", nbytes=data.numel(),
                            dtype=dtype, numel=data.numel(), tensors=specs)
    info = {"master_address": "10.0.0.5", "master_port": 29600, "rank_offset": 1, "world_size": 3,
            "group_name": "weightsync_1", "backend": "gloo"}
    entries = SGLangTensorTransport.serialized_for(payload, 2)
    fb = flat_bucket(payload.body)
    (tmp / "flat.bin").write_bytes(fb.data.numpy().tobytes())
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "expected.safetensors"))
    bodies = {
        "UpdateWeightsFromDistributedReqInput": a.distributed_body(header),
        "UpdateWeightsFromTensorReqInput": a.tensor_body(entries),
        "UpdateWeightFromDiskReqInput": a.disk_body("/ckpt/step_7", 7),
        "InitWeightsUpdateGroupReqInput": a.join_body(info),
        "DestroyWeightsUpdateGroupReqInput": a.leave_body(info),
        "UpdateWeightVersionReqInput": a.version_body(7),
        "PauseGenerationReqInput": a.pause_body("retract"),
        "ContinueGenerationReqInput": {},
    }
    job = {"bodies": bodies, "tensor_entries": entries, "expected": str(tmp / "expected.safetensors"),
           "flat_bytes": str(tmp / "flat.bin"), "wire_order": [e.name for e in fb.entries],
           # os.system, the classic pickle attack (not `print`: Ray replaces builtins.print in a
           # process that imported it, and the pickle would name Ray's function instead)
           "forbidden_entry": serialize([("x", torch.zeros(2)), os.system])}
    (tmp / "job.json").write_text(json.dumps(job))
    r = sglang_runner(CHECK, str(tmp / "job.json"))     # payload stays alive while SGLang maps it
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["_sent"] = bodies
    out["_names"] = sorted(sd)
    del payload
    return out


def test_runs_sglang_0_5_23_on_our_torch(checked: dict) -> None:
    assert checked["sglang_version"] == "0.5.23"
    assert checked["torch"] == torch.__version__          # sglang-ref shadows nothing


def test_bodies_validate_as_sglang_request_classes(checked: dict) -> None:
    for cls, sent in checked["_sent"].items():
        got = checked["bodies"][cls]
        assert got["type"] == cls
        assert got["unknown_keys"] == [], f"{cls}: keys SGLang would ignore: {got['unknown_keys']}"
        for k, v in sent.items():
            if k != "serialized_named_tensors":
                assert got["parsed"][k] == v, (cls, k)
    dist = checked["bodies"]["UpdateWeightsFromDistributedReqInput"]["parsed"]
    assert dist["load_format"] == "flattened_bucket" and dist["group_name"] == "weightsync_1"
    assert checked["bodies"]["UpdateWeightsFromTensorReqInput"]["entries_are_pickles"] == [True, True]


def test_standin_schemas_equal_sglangs_fields_and_defaults(checked: dict) -> None:
    ours = _standin_schemas()
    for cls, fields in ours.items():
        assert fields == checked["schemas"][cls], cls


def test_tensor_payload_decodes_with_sglangs_deserializer_and_bucket(checked: dict) -> None:
    ranks = checked["tensor"]["ranks"]
    assert len(ranks) == 2                                   # one entry per TP rank
    for r in ranks:
        assert r["ok"] is True and r["message"] == "Success"
        assert sorted(r["names"]) == checked["_names"] and r["mismatched"] == []
        assert r["metadata_classes"] == ["sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata"]
        assert r["flattened_dtype"] == "torch.uint8"


def test_flat_layout_is_sglangs_byte_offset_bucket(checked: dict) -> None:
    lay = checked["layout"]
    assert lay["supports_multi_dtypes"] is True
    assert lay["same_bytes_as_sglang_bucket"] and lay["metadata_matches"]
    assert lay["empty_bucket_bytes"] == lay["our_bytes"]
    assert sorted(lay["rebuilt"]) == checked["_names"] and lay["mismatched"] == []


def test_sglangs_allow_list_is_really_applied(checked: dict) -> None:
    assert checked["blocked"]["blocked"], checked["blocked"]
    assert re.search(r"Blocked unsafe global \((posix|os)\.system\)", checked["blocked"]["error"])


def test_weightsync_never_unpickles() -> None:
    """The plugin only dumps: no pickle.load(s) anywhere in its library code."""
    src = Path(__file__).parents[1] / "src" / "weightsync_sglang"
    for f in src.rglob("*.py"):
        calls = re.findall(r"pickle\.loads?\(|Unpickler\(|torch\.load\(|(?<!json)\.loads\(", f.read_text())
        assert calls == [], (f, calls)
    assert pickle.DEFAULT_PROTOCOL >= 2
