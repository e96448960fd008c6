"""The entry point is found, the exporter is registered under `megatron`, and its options refuse
what it cannot export before any rank moves a byte."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from weightsync import load_components, make_plugin_manager
from weightsync_megatron.exporter import MegatronExporter


def test_entry_point_is_discovered() -> None:
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="weightsync")}
    assert eps["megatron"].value == "weightsync_megatron.plugin"
    assert load_components(make_plugin_manager()).exporters.get("megatron") is MegatronExporter


def test_an_unknown_architecture_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "vocab_size": 9}))
    for options in ({"architecture": "DeepseekV3ForCausalLM"}, {"hf_config": str(tmp_path)}):
        with pytest.raises(ValidationError, match=r"does not know the architecture .*qwen3_moe"):
            MegatronExporter.Options(**options)
    with pytest.raises(ValidationError, match="needs `architecture`"):
        MegatronExporter.Options()


def test_hf_config_gives_architecture_and_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 151936}))
    o = MegatronExporter.Options(hf_config=str(tmp_path))
    assert (o.architecture, o.vocab_size) == ("qwen2", 151936)
