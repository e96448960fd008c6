"""A vLLM server started without --weight-transfer-config: the adapter's error names the flag,
and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from weightsync import SyncError, WeightSync
from weightsync.errors import EngineError
from weightsync_vllm.testing import Live, start_live, vllm_available

HAVE_VLLM, WHY_NOT = vllm_available()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    if not HAVE_VLLM:
        pytest.skip(reason=WHY_NOT)
    yield from start_live("llama", tmp_path_factory.mktemp("vllm-plain"), weight_transfer=None)


def test_missing_flag_is_named(plain: Live, tmp_path: Path) -> None:
    before = plain.greedy()
    with pytest.raises(EngineError, match="--weight-transfer-config"):
        plain.adapter().begin(1, {"transport": {"kind": "http"}, "encoding": {"kind": "raw"}})
    with WeightSync.from_config(plain.config("http")) as sync, pytest.raises(SyncError) as e:
        sync.push(plain.original, version=1)
    assert "--weight-transfer-config" in str(e.value)
    assert plain.version() == 0 and plain.greedy() == before
