"""Bad input (issue 15, item 5): an export whose names do not match the engine's checkpoint is
refused before anything is sent, listing the first mismatching names on both sides and the
exporter option that fixes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightsync import SyncError, WeightSync
from weightsync.exporters.names import NameMismatchError, check_names, checkpoint_names
from weightsync.exporters.torch import TorchExporter
from weightsync.testing import sample_state_dict, write_weights_only_model
from weightsync_reference.processes import EngineProcess

pytest.importorskip("transformers")


def moe() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from weightsync_reference.models import tiny_moe_config
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_moe_config("qwen3_moe", vocab=256))


def export(model, **options) -> list:  # noqa: ANN001
    return list(TorchExporter(TorchExporter.Options(**options)).buckets(model))


def test_layout_turned_off_names_both_sides_and_the_option(tmp_path: Path) -> None:
    model = moe()
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(NameMismatchError) as e:
        export(model, checkpoint_layout=False, expect_names_from=str(tmp_path / "ckpt"))
    msg = str(e.value)
    assert msg.splitlines()[0] == (
        f"the exported tensor names do not match the engine's checkpoint ({tmp_path / 'ckpt'}): "
        "4 would be sent that it does not have, 24 it has would not be sent; nothing was sent")
    assert ("  sent, not in the checkpoint: model.layers.0.mlp.experts.gate_up_proj, "
            "model.layers.0.mlp.experts.down_proj, model.layers.1.mlp.experts.gate_up_proj, "
            "model.layers.1.mlp.experts.down_proj") in msg
    assert ("  in the checkpoint, not sent: model.layers.0.mlp.experts.0.down_proj.weight, "
            "model.layers.0.mlp.experts.0.gate_proj.weight, model.layers.0.mlp.experts.0.up_proj.weight, "
            "model.layers.0.mlp.experts.1.down_proj.weight, model.layers.0.mlp.experts.1.gate_proj.weight "
            "... (19 more)") in msg
    assert msg.endswith("fix: set the exporter option checkpoint_layout: true (the engine loads the "
                        "checkpoint layout save_pretrained writes)")
    export(model, expect_names_from=str(tmp_path / "ckpt"))     # the default layout matches


def test_engine_holding_the_in_memory_layout_gets_the_other_hint(tmp_path: Path) -> None:
    model = moe()
    write_weights_only_model(tmp_path / "mem", dict(model.state_dict()))
    with pytest.raises(NameMismatchError, match=r"fix: set the exporter option checkpoint_layout: "
                                                r"false \(the engine holds transformers' in-memory"):
        export(model, expect_names_from=str(tmp_path / "mem"))


def test_a_prefix_difference_gets_the_rename_that_fixes_it(tmp_path: Path) -> None:
    sd = sample_state_dict()
    write_weights_only_model(tmp_path / "m", {f"language_model.{k}": v for k, v in sd.items()})
    with pytest.raises(NameMismatchError) as e:
        export(sd, expect_names_from=str(tmp_path / "m"))
    fix = str(e.value).splitlines()[-1]
    assert fix == 'fix: exporter option rename: [["^", "language_model."]]'
    sd2 = {k: v for k, v in sd.items() if k.startswith("model.")}
    export(sd2, rename=[("^", "language_model.")], skip=[r"\.lm_head\."],
           expect_names_from=str(tmp_path / "m"))          # skipped names may be missing


def test_unrelated_names_get_the_general_advice() -> None:
    with pytest.raises(NameMismatchError) as e:
        check_names(["a.qkv.weight"], ["a.q.weight", "a.k.weight", "a.v.weight"], where="x")
    msg = str(e.value)
    assert "  sent, not in the checkpoint: a.qkv.weight" in msg
    assert "  in the checkpoint, not sent: a.q.weight, a.k.weight, a.v.weight" in msg
    assert msg.splitlines()[-1].startswith("fix: map the names with the exporter option `rename`")
    assert "name_map" in msg and "split_fused" in msg


def test_checkpoint_names_from_an_index_or_files(tmp_path: Path) -> None:
    save_file({"b": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    assert checkpoint_names(tmp_path) == ["b"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x", "b": "y"}}))
    assert checkpoint_names(tmp_path) == ["a", "b"]
    with pytest.raises(FileNotFoundError):
        checkpoint_names(tmp_path / "nowhere")


def test_push_is_refused_before_any_byte_moves(tmp_path: Path) -> None:
    """Through the pipeline, against a real engine: the push fails with the exporter's message and
    the engine stays at its version, with its old weights."""
    model = moe()
    model.save_pretrained(tmp_path / "ckpt")
    from safetensors.torch import load_file
    engine_sd = load_file(tmp_path / "ckpt" / "model.safetensors")
    with EngineProcess(write_weights_only_model(tmp_path / "e", engine_sd)) as eng:
        cfg = {"engines": [eng.spec()], "sync": {"progress": "off"},
               "exporter": {"kind": "torch", "options": {"checkpoint_layout": False,
                                                         "expect_names_from": str(tmp_path / "ckpt")}}}
        with WeightSync.from_config(cfg) as sync, pytest.raises((SyncError, NameMismatchError)) as e:
            sync.push(model, version=1)     # the exporter's error, or a SyncError carrying it
        assert "sent, not in the checkpoint: model.layers.0.mlp.experts.gate_up_proj" in str(e.value)
        assert "checkpoint_layout: true" in str(e.value)
        assert eng.health()["version"] == 0
        cfg["exporter"]["options"]["checkpoint_layout"] = True
        with WeightSync.from_config(cfg) as sync:
            assert sync.push(model, version=1).verified
        assert eng.health()["version"] == 1
