"""Fixtures of the real-vLLM tests: ONE live server per model per module (~20-40 s to start),
shared by every check. Without vLLM importable they skip, saying how to install it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from weightsync_vllm.testing import Live, start_live, vllm_available

HAVE_VLLM, WHY_NOT = vllm_available()
API_KEY = "sk-weightsync-test"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A vLLM server with the weightsync backend and an API key, for a tiny Llama or Qwen2."""
    if not HAVE_VLLM:
        pytest.skip(reason=WHY_NOT)
    yield from start_live(request.param, tmp_path_factory.mktemp(f"vllm-{request.param}"),
                          api_key=API_KEY)
