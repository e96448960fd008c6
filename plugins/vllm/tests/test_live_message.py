"""A transport weightsync_vllm has never heard of pushes into a real vLLM server: `echo`
(echo_transport.py) with a message of its own ("echo.file"). It is installed in the server's
environment as an entry point, as pip would install it; the backend finds its receiving half
through the plugin registry, the adapter delivers its message whole (`VllmAdapter.deliver`), the
worker's receiving half stages it, and its answer comes back to the trainer."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from weightsync import WeightSync, make_plugin_manager
from weightsync.errors import EngineError
from weightsync.interfaces import Message
from weightsync.plugins import Components, load_components
from weightsync_vllm.testing import Live, start_live, vllm_available

HAVE_VLLM, WHY_NOT = vllm_available()
MODULE = "weightsync_echo_test"


def _install(site: Path) -> ModuleType:
    """echo_transport.py as an installed distribution in `site` (a module and a dist-info with
    its `weightsync` entry point), and the same module loaded here."""
    site.mkdir()
    shutil.copy(Path(__file__).with_name("echo_transport.py"), site / f"{MODULE}.py")
    dist = site / f"{MODULE}-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {MODULE}\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[weightsync]\necho = {MODULE}\n")
    spec = importlib.util.spec_from_file_location(MODULE, site / f"{MODULE}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def echo_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Live, Components]]:
    """A vLLM server whose environment has the `echo` transport installed, and the trainer's
    components with the same plugin registered."""
    if not HAVE_VLLM:
        pytest.skip(reason=WHY_NOT)
    root = tmp_path_factory.mktemp("vllm-echo")
    module = _install(root / "site")
    pm = make_plugin_manager()
    pm.register(module, name="echo")
    components = load_components(pm)
    path = os.pathsep.join(filter(None, [str(root / "site"), os.environ.get("PYTHONPATH")]))
    for live in start_live("llama", root, env={"PYTHONPATH": path}):
        yield live, components


def _perturbed(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in sd.items()}


def _config(live: Live, folder: Path) -> dict[str, Any]:
    return live.config({"kind": "echo", "options": {"dir": str(folder)}})


def test_a_third_party_transport_pushes_through_the_generic_message(
        echo_live: tuple[Live, Components], tmp_path: Path) -> None:
    """Every bucket goes as an "echo.file" message; each answer is the digest the vLLM worker
    staged (read in another process than this one), the round verifies against the worker's own
    digests, the new weights serve, and the original ones restore the original output."""
    live, components = echo_live
    assert "echo" not in load_components().transports      # nowhere but in that plugin manager
    before = live.greedy()
    v = live.version()
    with WeightSync.from_config(_config(live, tmp_path), components=components) as sync:
        report = sync.push(_perturbed(live.original, 3), version=v + 1)
        answers = list(sync.transport.answers)
    assert report.ok and report.verified, report
    assert sorted(report.digests) == list(range(report.buckets)) and report.buckets > 1
    assert [a["digest"] for a in answers] == [report.digests[i] for i in range(report.buckets)]
    assert all(a["pid"] != os.getpid() and a["nbytes"] > 0 for a in answers)
    assert live.version() == v + 1 and live.greedy() != before
    assert list(tmp_path.iterdir()) == []                  # every file was read, then removed
    with WeightSync.from_config(_config(live, tmp_path), components=components) as sync:
        assert sync.push(live.original, version=v + 2).verified
    assert live.greedy() == before


class _Unknown(Message):
    kind = "echo.nope"


def test_a_message_the_receiver_does_not_take_is_refused_and_nothing_changes(
        echo_live: tuple[Live, Components], tmp_path: Path) -> None:
    """The worker's receiving half refuses a kind it does not know; the refusal reaches the
    trainer in the engine's words, the round is dropped, and the engine serves what it held."""
    live, components = echo_live
    before, v = live.greedy(), live.version()
    plan = {"transport": {"kind": "echo", "options": {"dir": str(tmp_path)}},
            "encoding": {"kind": "raw", "options": {}}}
    a = live.adapter()
    try:
        a.begin(v + 1, plan)
        with pytest.raises(EngineError, match="takes no message 'echo.nope'"):
            a.deliver(_Unknown({"x": 1}))
        a.abort()
    finally:
        a.close()
    assert live.version() == v and live.greedy() == before
    with WeightSync.from_config(_config(live, tmp_path), components=components) as sync:
        assert sync.push(live.original, version=v + 1).verified    # the next round lands
    assert live.version() == v + 1 and live.greedy() == before
