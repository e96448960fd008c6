"""The backend as verl builds it (custom_backend_module, then CheckpointEngineRegistry.new), in
one process: actor ranks other than 0 only run the weights generator, options are checked."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

verl_ce = pytest.importorskip("verl.checkpoint_engine",
                              reason="verl is not installed here: `make test-verl` sets up its venv")
from verl.utils.import_utils import import_external_libs  # noqa: E402

CheckpointEngineRegistry = verl_ce.CheckpointEngineRegistry
import_external_libs("weightsync_verl")
WEIGHTS = {"model.embed_tokens.weight": torch.randn(16, 8), "lm_head.weight": torch.randn(16, 8)}


def test_other_actor_ranks_only_run_the_generator() -> None:
    """Actor ranks other than 0 (rank -1 in the topology) consume the weights (their gathers
    are collectives) and push nothing."""
    engine = CheckpointEngineRegistry.new("weightsync", bucket_size=2**20, is_master=False)
    engine.init_process_group(rank=-1, world_size=3, master_metadata={"url": "http://127.0.0.1:1"})
    seen: list[str] = []

    def gen() -> Any:
        for n, t in WEIGHTS.items():
            seen.append(n)
            yield n, t
    assert asyncio.run(engine.send_weights(gen(), global_steps=1)) == {}
    assert seen == list(WEIGHTS)


def test_unknown_and_reserved_options_are_refused() -> None:
    with pytest.raises(TypeError, match="unknown option.*colour"):
        CheckpointEngineRegistry.new("weightsync", bucket_size=2**20, colour="red")
    with pytest.raises(ValueError, match="config.fleet is set by the verl backend"):
        CheckpointEngineRegistry.new("weightsync", bucket_size=2**20, is_master=True,
                                     config={"fleet": {"kind": "static"}})
