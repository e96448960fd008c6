"""Fixtures for the disk_delta tests: a tiny bf16 LM trained with a real optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync_disk_delta.testing import Trainer


@pytest.fixture
def trainer(tmp_path: Path) -> Trainer:
    return Trainer(tmp_path / "model")
