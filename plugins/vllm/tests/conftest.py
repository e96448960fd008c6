"""Fixtures of the real-vLLM tests: ONE live server per model per module (~20-40 s to start),
shared by every check. Without vLLM importable they skip, saying how to install it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from weightsync_vllm.testing import Live, start_live, vllm_available

HAVE_VLLM, WHY_NOT = vllm_available()
API_KEY = "sk-weightsync-test"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A vLLM server with the weightsync backend and an API key, for a tiny Llama."""
    if not HAVE_VLLM:
        pytest.skip(reason=WHY_NOT)
    yield from start_live("llama", tmp_path_factory.mktemp("vllm-llama"), api_key=API_KEY)


@pytest.fixture(scope="module")
def live_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """The same for a tiny Qwen2 (q/k/v biases): a second architecture for the main test only
    (every other check is the same code path, and a vLLM start costs ~30 s on 2 cores)."""
    if not HAVE_VLLM:
        pytest.skip(reason=WHY_NOT)
    yield from start_live("qwen2", tmp_path_factory.mktemp("vllm-qwen2"), api_key=API_KEY)
