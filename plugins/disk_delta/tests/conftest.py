"""Fixtures for the disk_delta tests: a tiny bf16 LM trained with a real optimizer, and the
kernel paths an agent can take."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync_disk_delta.testing import KERNEL_PATHS, Trainer, use_kernel_path


@pytest.fixture
def trainer(tmp_path: Path) -> Trainer:
    return Trainer(tmp_path / "model")


@pytest.fixture(params=KERNEL_PATHS)
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    use_kernel_path(request.param, monkeypatch)
    return request.param
